"""The one definition of every configuration field: its default, its check and its section's
cross-field rules (issue 28).

Note [one definition]: every field of tiermem's configuration has one dotted name
(``optimizer.offload_fraction``, ``store.cpu_bytes``, ``budgets.gpu_bytes``) and is defined here
once, as an :class:`Option`: its default, the check that refuses a bad value (and normalizes a
good one: a dtype spelling to its canonical name, ``"4GiB"`` to bytes) and, per section, the
rules between fields (:data:`RULES`). Everything that takes a field takes it from here: the
YAML sections of :mod:`tiermem.config` (their dataclass defaults and ``__post_init__``), the
APIs (``HybridAdam``, ``offload_activations``, ``TierStore`` through ``StoreConfig``,
``tiermem.apps.plan.plan``, ``step_time``) and the command-line flags (:mod:`tiermem.flags` maps
each
flag to a dotted name). A user whose default differs on purpose declares it on the field, by
user name (:data:`USERS`), with the reason beside it; a message names the field with the user's
prefix (:class:`Who`: ``"optimizer."`` in YAML, ``"HybridAdam: "``, ``"plan: "``) and spells
None as the user does (``null`` in YAML). An option added later touches its definition here and
its use, nothing else; tests/test_options.py walks every user and fails when one drifts.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tiermem.names import (AUTO_BOOL, IO_BACKENDS, MODEL_DTYPES, MOMENTS_DTYPES, OFFLOAD_TIERS,
                           PARAM_SYNCS, PLACEMENTS, POLICIES, STATE_TIERS, check_aligned,
                           check_bool, check_choice, check_device, check_fraction, check_int,
                           check_number, dtype_name, parse_bytes, short_repr)

logger = logging.getLogger("tiermem")

USERS = ("api", "loop", "plan", "plan-cli", "tune")
"""Who takes a field: ``api`` (HybridAdam, offload_activations, StoreConfig/TierStore: the
library's defaults), ``loop`` (the training loop's YAML sections: OptimizerConfig,
ActivationConfig, TrainConfig, BudgetConfig of tiermem demo and the examples), ``plan``
(``tiermem.apps.plan.plan`` and ``tiermem plan``), ``plan-cli`` (``tiermem plan`` where its
default differs from ``plan()``'s), ``tune`` (``tiermem tune``)."""

STREAM_TIERS = ("cpu", "nvme")
"""``streaming.tier``: the streamed weights' home (pinned RAM, or NVMe behind RAM staging)."""
STREAM_SCHEDULES = ("block-major", "depth-first")
"""``streaming.schedule``: how a step's micro-batches visit the streamed blocks."""
STREAM_OPTIMIZERS = ("hybrid", "torch")
"""``streaming.optimizer``: HybridAdam or torch.optim.AdamW (examples/train_large.py)."""

GB, GiB = 10**9, 2**30
H200_GPU_BYTES = 141 * GB
"""The planner's GPU capacity: one H200 (141 GB = 131.3 GiB)."""
H200_HOST_BYTES = 128 * GiB
"""The planner's host RAM: the H200 machine's 128 GiB."""
H200_NVME_BYTES = 64 * GiB
"""The planner's NVMe space for spill files."""


@dataclass(frozen=True)
class Who:
    """Who checks a value: the prefix of its messages (with its separator) and how it spells
    None (``"None"`` in Python, ``"null"`` in YAML)."""

    prefix: str
    none: str = "None"

    def spell(self, text: str) -> str:
        """``text`` with ``{none}`` in this user's spelling."""
        return text.replace("{none}", self.none)

    def name(self, section: str, field_name: str) -> str:
        """A field as this user's messages name it: ``activations.prefetch_depth`` in a
        section (prefix ending in ``.``), else ``prefetch_depth``."""
        return f"{section}.{field_name}" if self.prefix.endswith(".") else field_name


Check = Callable[[Who, str, Any], Any]


@dataclass(frozen=True)
class Option:
    """One configuration field (Note [one definition]).

    Attributes:
        section: the section (``"optimizer"``).
        name: the field (``"offload_fraction"``).
        default: the library's default (user ``api``).
        check: ``check(who, name, value)`` returns the normalized value or raises ValueError /
            TypeError naming ``who.prefix + name``.
        defaults: user -> its default where it differs from ``default`` (the reason beside it).
        none: what None means when every user accepts it (``"to size it from the model"``);
            "" : None is accepted only by a user whose default is None.
        users: the users that take this field.
        bad: a value the check refuses (tests/test_options.py feeds it to every user).
    """

    section: str
    name: str
    default: Any
    check: Check
    defaults: Mapping[str, Any] = field(default_factory=dict)
    none: str = ""
    users: tuple[str, ...] = ("api", "loop")
    bad: Any = None

    @property
    def dotted(self) -> str:
        """``section.name``."""
        return f"{self.section}.{self.name}"

    def default_for(self, user: str) -> Any:
        """The default of ``user`` (one of :data:`USERS`; ``plan-cli`` falls back to
        ``plan``'s)."""
        if user == "plan-cli" and user not in self.defaults:
            user = "plan"
        return self.defaults.get(user, self.default)

    def __call__(self, who: Who, value: Any, user: str = "api", name: str | None = None) -> Any:
        """Check ``value`` for ``user``; return it normalized. ``name``: what the user calls
        the field, where it differs (``plan(activation_tier=...)`` is ``activations.tier``).

        Raises:
            ValueError, TypeError: a bad value, naming ``who.prefix + name`` and the fix.
        """
        if value is None and (self.none or self.default_for(user) is None):
            return None
        return self.check(who, name or self.name, value)


# ------------------------------------------------------------------ checks


def _number(low: float | None = None, *, low_open: bool = False, fix: str = "") -> Check:
    return lambda who, name, v: check_number(who.prefix, name, v, low=low, low_open=low_open,
                                             fix=who.spell(fix))


def _int(low: int, unit: str = "", fix: str = "") -> Check:
    return lambda who, name, v: check_int(who.prefix, name, v, low=low, unit=unit,
                                          fix=who.spell(fix))


def _fraction(meaning: str) -> Check:
    return lambda who, name, v: check_fraction(who.prefix, name, v, meaning)


def _choice(choices: tuple, fix: str = "") -> Check:
    return lambda who, name, v: check_choice(who.prefix, name, v, choices, fix)


def _bool(who: Who, name: str, v: Any) -> bool:
    return check_bool(who.prefix, name, v)


def _dtype(choices: tuple) -> Check:
    return lambda who, name, v: dtype_name(who.prefix, name, v, choices)


def _bytes(who: Who, name: str, v: Any) -> int:
    return parse_bytes(v, f"{who.prefix}{name}")


def _aligned_bytes(align: int, why: str) -> Check:
    def check(who: Who, name: str, v: Any) -> int:
        return check_aligned(who.prefix, name, parse_bytes(v, f"{who.prefix}{name}"), align, why)
    return check


def _kept_bytes(who: Who, name: str, v: Any) -> int:
    if isinstance(v, str):
        v = parse_bytes(v, f"{who.prefix}{name}")
    return check_int(who.prefix, name, v, low=0, unit="bytes")


def _slab_bytes(who: Who, name: str, v: Any) -> int:
    return check_int(who.prefix, name, parse_bytes(v, f"{who.prefix}{name}"), low=4096,
                     unit="bytes")


def _path(who: Who, name: str, v: Any) -> str:
    return os.fspath(v)


def _device(who: Who, name: str, v: Any) -> str:
    return check_device(who.prefix, name, v)


def _betas(who: Who, name: str, v: Any) -> tuple:
    if not (isinstance(v, (list, tuple)) and len(v) == 2):
        raise ValueError(f"{who.prefix}{name}={short_repr(v)} must be two numbers (the averaging "
                         f"coefficients of the gradient and of its square), e.g. (0.9, 0.999)")
    for i, beta in enumerate(v):
        check_number(who.prefix, f"{name}[{i}]", beta, low=0.0, high=1.0, high_open=True)
    return tuple(v)


def _policy(who: Who, name: str, v: Any) -> Any:
    if isinstance(v, str):
        check_choice(who.prefix, name, v, POLICIES, "or pass a tiermem.store.policy.Policy "
                     "instance")
    return v


def _blocks_or_auto(who: Who, name: str, v: Any) -> int | str:
    if v != "auto":
        check_int(who.prefix, name, v, low=0, unit="blocks",
                  fix="give 0 (depth-first), a count of blocks, or 'auto'")
    return v


# ------------------------------------------------------------------ the fields

_O, _A, _S, _B, _T, _W = "optimizer", "activations", "store", "budgets", "train", "streaming"
_APL = ("api", "loop", "plan")
_LOOP_PLAN = ("loop", "plan")
_ALL = ("api", "loop", "plan", "tune")

_FIELDS = [
    # ---- optimizer: HybridAdam's arguments (the loop's defaults train tiermem demo's small GPT)
    Option(_O, "lr", 1e-3, _number(0.0), {"loop": 3e-3}, bad=-1.0),
    Option(_O, "betas", (0.9, 0.999), _betas, {"loop": (0.9, 0.95)}, bad=[0.9, 1.0]),
    Option(_O, "eps", 1e-8, _number(0.0), bad=-1e-8),
    Option(_O, "weight_decay", 1e-2, _number(0.0), {"loop": 0.1}, bad=-0.1),
    Option(_O, "adamw", True, _bool, bad="yes"),
    Option(_O, "maximize", False, _bool, bad=1),
    # plan: None is "the least that fits"; loop: half, for the demo to show both sides
    Option(_O, "offload_fraction", 1.0, _fraction(
        "it is the fraction of parameter bytes whose optimizer state leaves the GPU (0.0 = "
        "none, 1.0 = all)"), {"loop": 0.5, "plan": None, "tune": (0.0, 0.5, 1.0)},
        users=_ALL, bad=1.5),
    # plan: "auto" is RAM if it fits, else split; tune: its grid, cpu and nvme
    Option(_O, "state_tier", "cpu", _choice(
        STATE_TIERS, "cpu is pinned RAM, nvme spill files, split RAM up to the store's cpu "
        "budget and the rest on NVMe"), {"plan": "auto", "tune": ("cpu", "nvme")},
        users=_ALL, bad="disk"),
    Option(_O, "nvme_dir", None, _path, none="is allowed"),
    Option(_O, "overlap", True, _bool, bad=1),
    Option(_O, "chunk_numel", None, _int(1024, "elements", "or {none} to size it from the model"),
           none="sizes it from the model", users=_APL, bad=1000),
    Option(_O, "max_grad_norm", None, _number(0.0, low_open=True, fix="or {none} for no clipping"),
           none="is no clipping", users=_APL, bad=0),
    # Note [speculative step] in tiermem/optim/speculate.py: 0 keeps every chunk waiting
    Option(_O, "rollback_bytes", 0, _bytes, bad=-1),
    # loop: null is "the training loop's count" (train.grad_accumulation_steps)
    Option(_O, "grad_accumulation_steps", 1, _int(1, fix="the backward passes per step()"),
           {"loop": None}, bad=0),
    Option(_O, "moments_dtype", "float32", _dtype(MOMENTS_DTYPES), users=_APL, bad="fp16"),
    Option(_O, "cpu_threads", None, _int(1, "threads", "or {none} for torch's thread count"),
           none="is torch's thread count", users=("api", "loop", "tune"), bad=0),
    Option(_O, "nvme_lookahead_chunks", 2, _int(0, "chunks"), users=_APL, bad=-1),
    Option(_O, "data_parallel", None, _bool, none="is on when a process group is passed",
           bad="on"),
    Option(_O, "bucket_numel", 1 << 23, _int(1, "elements", "the elements per gradient-reduce "
                                                            "bucket"), bad=0),
    Option(_O, "param_sync", "step", _choice(
        PARAM_SYNCS, "step: the updated params are ready when step() returns, forward: the next "
        "forward waits per module"), users=_APL, bad="later"),
    Option(_O, "placement", "trace", _choice(
        PLACEMENTS, "trace: the split follows the gradient order of the first backward, given: "
        "the order the params were given in"), bad="random"),
    Option(_O, "gpu_step_fraction", 0.0, _fraction(
        "it is the share of the offloaded chunks the GPU steps by streaming their state "
        "through it (0.0: the CPU steps all)"), users=_APL, bad=2),
    # ---- activations: offload_activations' arguments
    Option(_A, "enabled", True, _bool, users=("loop",), bad=1),
    Option(_A, "tier", "cpu", _choice(OFFLOAD_TIERS, "'cpu' is pinned host memory, 'nvme' "
                                                     "spill files"), users=_APL, bad="gpu"),
    # api: None with layers=None is "auto"; plan: None is 0, or all but one when needed;
    # tune: its grid, none and all but the last (None)
    Option(_A, "num_layers", None, _int(0, "blocks", "or {none} to choose by measurement"),
           none="chooses by measurement", users=_ALL, bad=-1),
    Option(_A, "prefetch_depth", 1, _int(1, "layers", "the layers reloaded ahead of the one "
                                                      "backward is in"),
           {"tune": (1, 2)}, users=_ALL, bad=0),
    Option(_A, "min_offload_bytes", 1024, _int(0, "bytes"), bad=-1),
    Option(_A, "offload_weights", False, _bool, bad=1),
    Option(_A, "double_buffering", False, _bool, bad="yes"),
    Option(_A, "max_kept_bytes", None, _kept_bytes, none="is no bound but the device's memory",
           bad="lots"),
    # ---- store: StoreConfig (TierStore); the budgets are the tiers' hard limits in bytes
    Option(_S, "gpu_bytes", "2GiB", _bytes, bad="lots"),
    Option(_S, "cpu_bytes", "4GiB", _bytes, bad=-1),
    Option(_S, "nvme_bytes", 0, _bytes, bad="lots"),
    Option(_S, "nvme_dir", None, _path, none="is allowed"),
    Option(_S, "device", "auto", _device, bad="tpu"),
    Option(_S, "pin_memory", "auto", _choice(AUTO_BOOL, "auto pins when the device is CUDA"),
           bad=1),
    Option(_S, "pool_slab_bytes", "256MiB", _slab_bytes, bad=100),
    Option(_S, "io_backend", "auto", _choice(IO_BACKENDS, "auto is posix; kvikio only when "
                                                          "named"), bad="tape"),
    Option(_S, "io_threads", 4, _int(1, "threads"), bad=0),
    Option(_S, "io_chunk_bytes", "8MiB", _aligned_bytes(4096, "O_DIRECT alignment"), bad=1000),
    Option(_S, "o_direct", "auto", _choice(AUTO_BOOL, "auto uses O_DIRECT when the filesystem "
                                                      "supports it"), bad="yes"),
    Option(_S, "checksum", True, _bool, bad=1),
    Option(_S, "policy", "lru", _policy, {"tune": ("lru",)}, users=("api", "loop", "tune"),
           bad="mru"),
    Option(_S, "prefetch_lookahead", 0, _int(0, "accesses looked ahead", "0 turns prefetch off"),
           {"tune": (16,)}, users=("api", "loop", "tune"), bad=-1),
    # ---- budgets: the machine's capacities a run is planned against (loop: null is the
    # planner's default, the H200 machine; tune: None is 3/4 of the no-offload need / none)
    Option(_B, "gpu_bytes", H200_GPU_BYTES, _bytes, {"loop": None, "tune": None},
           users=("loop", "plan", "tune"), bad="lots"),
    Option(_B, "host_bytes", H200_HOST_BYTES, _bytes, {"loop": None, "tune": None},
           users=("loop", "plan", "tune"), bad="lots"),
    Option(_B, "nvme_bytes", H200_NVME_BYTES, _bytes, {"loop": None},
           users=("loop", "plan"), bad="lots"),
    Option(_B, "gpu_reserve_bytes", None, _bytes, none="is 1 GiB + 5 % of the GPU",
           users=("plan",), bad="lots"),
    Option(_B, "host_reserve_bytes", 8 * GiB, _bytes, users=("plan",), bad="lots"),
    # ---- train: the loop of tiermem demo and examples/train_gpt.py (and train_large.py)
    Option(_T, "steps", 30, _int(1), users=("loop",), bad=0),
    Option(_T, "micro_batch", 8, _int(1), users=("loop",), bad=0),
    Option(_T, "grad_accumulation_steps", 1, _int(1), users=_LOOP_PLAN, bad=0),
    Option(_T, "seq_len", None, _int(1, "tokens"), none="is the model's", users=("loop",),
           bad=0),
    Option(_T, "dtype", "float32", _dtype(MODEL_DTYPES), users=("loop",), bad="float16"),
    Option(_T, "device", "auto", _device, users=("loop",), bad="tpu"),
    Option(_T, "seed", 0, _int(0), users=("loop",), bad=-1),
    Option(_T, "checkpoint", False, _bool, users=_LOOP_PLAN, bad=1),
    Option(_T, "breadth_first_blocks", 0, _blocks_or_auto, users=_LOOP_PLAN, bad=-1),
    Option(_T, "baseline", True, _bool, users=("loop",), bad=1),
    Option(_T, "tolerance", 1e-6, _number(0.0), users=("loop",), bad=-1),
    Option(_T, "markov_branching", 4, _int(1), users=("loop",), bad=0),
    Option(_T, "log_every", 1, _int(0), users=("loop",), bad=-1),
    Option(_T, "progress", True, _bool, users=("loop",), bad=1),
    # ---- streaming: weight streaming of examples/train_large.py (stream_weights' arguments);
    # plan: enabled "auto" streams only when the GPU cannot hold every weight, tier "auto" is
    # RAM if the run fits so, schedule "auto" is block-major (docs/streaming.md)
    Option(_W, "enabled", False, _bool, {"plan-cli": "auto"}, users=_LOOP_PLAN, bad=1),
    Option(_W, "tier", "cpu", _choice(STREAM_TIERS, "cpu is pinned RAM, nvme the store's spill "
                                                    "files"), {"plan": "auto"},
           users=_LOOP_PLAN, bad="gpu"),
    Option(_W, "prefetch_blocks", 1, _int(0, "blocks"), users=_LOOP_PLAN, bad=-1),
    Option(_W, "gpu_bytes", None, _bytes, none="is the plan's choice", users=("loop",),
           bad="lots"),
    Option(_W, "schedule", "block-major", _choice(STREAM_SCHEDULES, "block-major fetches each "
                                                  "streamed block once per pass"),
           {"plan": "auto"}, users=_LOOP_PLAN, bad="random"),
    Option(_W, "optimizer", "hybrid", _choice(STREAM_OPTIMIZERS, "hybrid is HybridAdam, torch "
                                              "is torch.optim.AdamW"), users=("loop",),
           bad="sgd"),
]

OPTIONS: dict[str, Option] = {o.dotted: o for o in _FIELDS}
"""Dotted name -> its :class:`Option`, sections in order."""


def section(name: str, user: str | None = None) -> dict[str, Option]:
    """The options of section ``name`` (field -> Option), those ``user`` takes when given."""
    return {o.name: o for o in _FIELDS if o.section == name and (user is None or user in o.users)}


def defaults(name: str, user: str) -> dict[str, Any]:
    """Field -> ``user``'s default, for the fields of section ``name`` that ``user`` takes."""
    return {f: o.default_for(user) for f, o in section(name, user).items()}


def default(dotted: str, user: str = "api") -> Any:
    """``user``'s default of the field ``dotted``."""
    return OPTIONS[dotted].default_for(user)


def check(dotted: str, who: Who, value: Any, user: str = "api", name: str | None = None) -> Any:
    """Check one field's value for ``user``; return it normalized (``name``: what ``user``
    calls the field, where it differs).

    Raises:
        ValueError, TypeError: a bad value (naming the field and the fix).
    """
    return OPTIONS[dotted](who, value, user, name)


# ------------------------------------------------------------------ cross-field rules


def _double_buffering_rule(who: Who, v: dict) -> None:
    if v.get("double_buffering") and v.get("prefetch_depth", 1) != 1:
        d = v["prefetch_depth"]
        raise ValueError(f"{who.prefix}double_buffering=True needs "
                         f"{who.name(_A, 'prefetch_depth')}=1 (got {d}): two buffer sets hold "
                         f"the layer in use and the one loading, so prefetch_depth={d} cannot "
                         f"work; pass prefetch_depth=1 or double_buffering=False")


def _kept_bytes_rule(who: Who, v: dict) -> None:
    explicit = v.get("num_layers") is not None or v.get("layers") not in (None, "auto")
    if v.get("max_kept_bytes") is not None and explicit:
        raise ValueError(f"{who.prefix}max_kept_bytes bounds the automatic choice of layers; "
                         f"with {who.name(_A, 'num_layers')}={v.get('num_layers')!r} "
                         f"(or layers) set it to {who.none} (or set num_layers to {who.none}, "
                         f"layers='auto')")


def _spill_dir_rule(who: Who, v: dict) -> None:
    if v["nvme_bytes"] > 0 and not v["nvme_dir"]:
        raise ValueError(
            f"{who.prefix}nvme_bytes={v['nvme_bytes']} needs a spill directory: set "
            f"{who.prefix}nvme_dir to a writable directory on an SSD, or nvme_bytes=0")
    if v["nvme_dir"] is not None and v["nvme_bytes"] == 0:
        msg = (f"{who.prefix}nvme_dir={short_repr(v['nvme_dir'])} is ignored because "
               f"{who.prefix}nvme_bytes=0 (the nvme tier is off); set nvme_bytes (e.g. "
               f"'64GiB') to spill there, or drop nvme_dir")
        logger.warning(msg)  # 0 is the documented off switch: a warning, not an error
        warnings.warn(msg, UserWarning, stacklevel=6)  # the caller of StoreConfig(...)


def _lookahead_rule(who: Who, v: dict) -> None:
    if v["prefetch_lookahead"] and v["policy"] == "lru":
        raise ValueError(f"{who.prefix}prefetch_lookahead={v['prefetch_lookahead']} needs the "
                         f"recorded step of the trace policy: set {who.prefix}policy='trace', "
                         f"or prefetch_lookahead=0")


RULES: dict[str, dict[str, Callable[[Who, dict], None]]] = {
    _A: {"double_buffering": _double_buffering_rule, "max_kept_bytes": _kept_bytes_rule},
    _S: {"nvme_dir": _spill_dir_rule, "prefetch_lookahead": _lookahead_rule},
}
"""Section -> its cross-field rules by name, each ``rule(who, values)`` (values: field ->
normalized value; a rule reads only the fields it names, with their defaults when absent)."""


def check_rule(name: str, rule: str, who: Who, values: dict[str, Any]) -> None:
    """Apply one rule of section ``name`` (a user that checks the fields in another order).

    Raises:
        ValueError: the rule is broken (naming the fields and the fix).
    """
    RULES[name][rule](who, values)


def check_section(name: str, who: Who, values: dict[str, Any], user: str = "api",
                  rules: bool = True) -> dict[str, Any]:
    """Check each field of ``values`` (a subset of section ``name``) for ``user``, in the
    section's order, then the section's rules; return the normalized values (others as given).

    Raises:
        ValueError, TypeError: a bad value or a broken rule, naming the field and the fix.
    """
    options = section(name)
    out = dict(values)
    for field_name, option in options.items():
        if field_name in values:
            out[field_name] = option(who, values[field_name], user)
    if rules:
        for rule in RULES.get(name, {}).values():
            rule(who, out)
    return out
