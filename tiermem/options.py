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
        type: the field's annotation in its section's dataclass (a string, as
            ``from __future__ import annotations`` keeps it; ``| None`` is added for a user
            that accepts None: :meth:`annotation`).
        doc: what the field means, with its unit: the docstring of the field in its section's
            dataclass (Note [fields from the table] in tiermem/config.py).
    """

    section: str
    name: str
    default: Any
    check: Check
    defaults: Mapping[str, Any] = field(default_factory=dict)
    none: str = ""
    users: tuple[str, ...] = ("api", "loop")
    bad: Any = None
    type: str = "Any"
    doc: str = ""

    @property
    def dotted(self) -> str:
        """``section.name``."""
        return f"{self.section}.{self.name}"

    def annotation(self, user: str) -> str:
        """The field's annotation for ``user``: :attr:`type`, with ``| None`` where ``user``
        takes None (its default is None, or None has a meaning for every user)."""
        takes_none = bool(self.none) or self.default_for(user) is None
        return f"{self.type} | None" if takes_none and "None" not in self.type else self.type

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


def _lit(choices: tuple) -> str:
    """The annotation ``Literal['a', 'b']`` of a choice among ``choices``."""
    return f"Literal[{', '.join(map(repr, choices))}]"


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
    Option(_O, "lr", 1e-3, _number(0.0), {"loop": 3e-3}, bad=-1.0, type="float",
           doc="Learning rate."),
    Option(_O, "betas", (0.9, 0.999), _betas, {"loop": (0.9, 0.95)}, bad=[0.9, 1.0],
           type="tuple[float, float]", doc="Coefficients of the running averages of the "
           "gradient and its square, each in [0, 1)."),
    Option(_O, "eps", 1e-8, _number(0.0), bad=-1e-8, type="float",
           doc="Term added to the denominator."),
    Option(_O, "weight_decay", 1e-2, _number(0.0), {"loop": 0.1}, bad=-0.1, type="float",
           doc="Weight decay: decoupled (AdamW) with ``adamw``, else an L2 penalty. The "
           "examples apply it to matrices only (not biases, norms)."),
    Option(_O, "adamw", True, _bool, bad="yes", type="bool", doc="Decoupled weight decay "
           "(torch.optim.AdamW) or L2 penalty (torch.optim.Adam)."),
    Option(_O, "maximize", False, _bool, bad=1, type="bool", doc="Maximize the objective."),
    # plan: None is "the least that fits"; loop: half, for the demo to show both sides
    Option(_O, "offload_fraction", 1.0, _fraction(
        "it is the fraction of parameter bytes whose optimizer state leaves the GPU (0.0 = "
        "none, 1.0 = all)"), {"loop": 0.5, "plan": None, "tune": (0.0, 0.5, 1.0)},
        users=_ALL, bad=1.5, type="float",
        doc="Fraction of parameter bytes whose fp32 master and moments live off the GPU, in "
        "[0.0, 1.0]; the last layers go first. 0.0 keeps everything on the GPU."),
    # plan: "auto" is RAM if it fits, else split; tune: its grid, cpu and nvme
    Option(_O, "state_tier", "cpu", _choice(
        STATE_TIERS, "cpu is pinned RAM, nvme spill files, split RAM up to the store's cpu "
        "budget and the rest on NVMe"), {"plan": "auto", "tune": ("cpu", "nvme")},
        users=_ALL, bad="disk", type=_lit(STATE_TIERS),
        doc="Where offloaded state lives: ``\"cpu\"`` (pinned RAM), ``\"nvme\"`` (spill files: "
        "needs store.nvme_bytes and store.nvme_dir, or ``nvme_dir`` without a store) or "
        "``\"split\"`` (RAM up to the store's cpu budget, the rest on NVMe: needs a store with "
        "nvme_bytes)."),
    Option(_O, "nvme_dir", None, _path, none="is allowed", type="str",
           doc="Spill directory of HybridAdam's private store (``state_tier=\"nvme\"`` without "
           "a store); with a store, set ``store.nvme_dir`` instead."),
    Option(_O, "overlap", True, _bool, bad=1, type="bool", doc="Step offloaded chunks on the "
           "CPU during backward, as their gradients land."),
    Option(_O, "chunk_numel", None, _int(1024, "elements", "or {none} to size it from the model"),
           none="sizes it from the model", users=_APL, bad=1000, type="int",
           doc="Elements per offloaded chunk (unit of the CPU step and NVMe I/O), >= 1024; "
           "null: sized from the model (1/32 of the offloaded elements, within [2^16, 2^24])."),
    Option(_O, "max_grad_norm", None, _number(0.0, low_open=True, fix="or {none} for no clipping"),
           none="is no clipping", users=_APL, bad=0, type="float",
           doc="Clip gradients to this global 2-norm inside ``step()``; None: no clipping."),
    # loop: null is "the training loop's count" (train.grad_accumulation_steps)
    Option(_O, "grad_accumulation_steps", 1, _int(1, fix="the backward passes per step()"),
           {"loop": None}, bad=0, type="int",
           doc="Backward passes per ``step()``; null: the training loop's count (both examples "
           "pass ``train.grad_accumulation_steps``; set it here only where nothing else does)."),
    Option(_O, "moments_dtype", "float32", _dtype(MOMENTS_DTYPES), users=_APL, bad="fp16",
           type=_lit(MOMENTS_DTYPES),
           doc="Dtype of the Adam moments, on the GPU side and the offloaded side alike: "
           "``\"float32\"`` (exact torch semantics; 12 bytes of offloaded state per param, 8 on "
           "the GPU side plus 4 for the fp32 master of a non-fp32 param) or ``\"bfloat16\"`` (8 "
           "bytes per offloaded param, 4 + 4 on the GPU side; moments rounded to bf16 after "
           "each update). Masters stay fp32."),
    Option(_O, "cpu_threads", None, _int(1, "threads", "or {none} for torch's thread count"),
           none="is torch's thread count", users=("api", "loop", "tune"), bad=0, type="int",
           doc="Threads of the CPU step; None: torch's thread count (less one with overlap on "
           "CUDA)."),
    Option(_O, "nvme_lookahead_chunks", 2, _int(0, "chunks"), users=_APL, bad=-1, type="int",
           doc="Chunks of NVMe-resident state read ahead of the CPU step "
           "(``state_tier=\"nvme\"``)."),
    Option(_O, "data_parallel", None, _bool, none="is on when a process group is passed",
           bad="on", type="bool", doc="Shard the state across the ranks (ZeRO-1/2); null: on "
           "when a process group is passed."),
    Option(_O, "bucket_numel", 1 << 23, _int(1, "elements", "the elements per gradient-reduce "
                                                            "bucket"), bad=0, type="int",
           doc="Elements per gradient-reduce bucket with ``data_parallel``."),
    Option(_O, "param_sync", "step", _choice(
        PARAM_SYNCS, "step: the updated params are ready when step() returns, forward: the next "
        "forward waits per module"), users=_APL, bad="later", type=_lit(PARAM_SYNCS),
        doc="When the updated offloaded params are waited for: in ``step()`` or in the next "
        "forward."),
    Option(_O, "placement", "trace", _choice(
        PLACEMENTS, "trace: the split follows the gradient order of the first backward, given: "
        "the order the params were given in"), bad="random", type=_lit(PLACEMENTS),
        doc="Which elements keep their state on the GPU: by the first backward's gradient "
        "order (``\"trace\"``) or by the order the params were given in (``\"given\"``)."),
    Option(_O, "gpu_step_fraction", 0.0, _fraction(
        "it is the share of the offloaded chunks the GPU steps by streaming their state "
        "through it (0.0: the CPU steps all)"), users=_APL, bad=2, type="float",
        doc="Share of the offloaded chunks the GPU steps by streaming their state through it, "
        "in [0.0, 1.0] (1.0 is fastest at full offload when PCIe is not busy with "
        "activations)."),
    # Note [speculative step] in tiermem/optim/speculate.py: 0 keeps every chunk waiting
    Option(_O, "rollback_bytes", 0, _bytes, users=_APL, bad=-1, type="int | str",
           doc="Host RAM (bytes or ``\"4GiB\"``) for pre-step copies of chunk state: with "
           "``max_grad_norm`` chunks step during backward and are rolled back when the norm "
           "clips (Note [speculative step] in tiermem/optim/speculate.py); 0: they wait for the "
           "norm. The GPU lane's share of it is held in GPU memory instead "
           "(Note [lane rollback on the GPU]); the planner counts both."),
    # ---- activations: offload_activations' arguments
    Option(_A, "enabled", True, _bool, users=("loop",), bad=1, type="bool",
           doc="Offload saved activations at all (False: they stay on the device)."),
    Option(_A, "tier", "cpu", _choice(OFFLOAD_TIERS, "'cpu' is pinned host memory, 'nvme' "
                                                     "spill files"), users=_APL, bad="gpu",
           type=_lit(OFFLOAD_TIERS), doc="``\"cpu\"`` (pinned host memory) or ``\"nvme\"`` "
           "(needs store.nvme_bytes and nvme_dir)."),
    # api: None with layers=None is "auto"; plan: None is 0, or all but one when needed;
    # tune: its grid, none and all but the last (None)
    Option(_A, "num_layers", None, _int(0, "blocks", "or {none} to choose by measurement"),
           none="chooses by measurement", users=_ALL, bad=-1, type="int",
           doc="Offload the first N blocks, in [0, n_layers); None: chosen by measurement "
           "(``layers=\"auto\"``: the blocks whose copies hide behind compute, see "
           "``offload_activations``)."),
    Option(_A, "prefetch_depth", 1, _int(1, "layers", "the layers reloaded ahead of the one "
                                                      "backward is in"),
           {"tune": (1, 2)}, users=_ALL, bad=0, type="int",
           doc="Layers reloaded ahead of the one backward is in (>= 1)."),
    Option(_A, "min_offload_bytes", 1024, _int(0, "bytes"), bad=-1, type="int",
           doc="Saved tensors smaller than this many bytes stay on the device."),
    Option(_A, "offload_weights", False, _bool, bad=1, type="bool",
           doc="Also offload parameters and buffers that autograd saves."),
    Option(_A, "double_buffering", False, _bool, bad="yes", type="bool",
           doc="Reload into two persistent device buffer sets (needs prefetch_depth=1)."),
    Option(_A, "max_kept_bytes", None, _kept_bytes, none="is no bound but the device's memory",
           bad="lots", type="int | str",
           doc="With num_layers null: at most this many bytes of block activations stay on the "
           "device (``\"8GiB\"``); null: bounded by the device memory left unused (CUDA) or not "
           "at all (CPU)."),
    # ---- store: StoreConfig (TierStore); the budgets are the tiers' hard limits in bytes
    Option(_S, "gpu_bytes", "2GiB", _bytes, bad="lots", type="int | str",
           doc="Budget of the ``\"gpu\"`` tier (on a machine without CUDA: a device tier in "
           "host memory)."),
    Option(_S, "cpu_bytes", "4GiB", _bytes, bad=-1, type="int | str",
           doc="Budget of the ``\"cpu\"`` tier: host memory from the (pinned, when CUDA is "
           "there) pool."),
    Option(_S, "nvme_bytes", 0, _bytes, bad="lots", type="int | str",
           doc="Budget of the ``\"nvme\"`` tier: bytes of spill-file extents. 0 disables the "
           "tier."),
    Option(_S, "nvme_dir", None, _path, none="is allowed", type="str",
           doc="Base directory for spill files; the store makes a private (0700) subdirectory "
           "in it. Required when ``nvme_bytes`` > 0."),
    Option(_S, "device", "auto", _device, bad="tpu", type="str",
           doc="Compute device of the ``\"gpu\"`` tier: ``\"auto\"`` (CUDA if present, else "
           "CPU), ``\"cuda\"``, ``\"cuda:N\"`` or ``\"cpu\"``."),
    Option(_S, "pin_memory", "auto", _choice(AUTO_BOOL, "auto pins when the device is CUDA"),
           bad=1, type="bool | Literal['auto']",
           doc="Pin the ``\"cpu\"`` tier's pool (``\"auto\"``: when the device is CUDA)."),
    Option(_S, "pool_slab_bytes", "256MiB", _slab_bytes, bad=100, type="int | str",
           doc="Size of one host-pool slab; the pool grows by slabs up to ``cpu_bytes`` and "
           "reuses freed blocks (pinned allocation costs ~0.5 s/GiB)."),
    Option(_S, "io_backend", "auto", _choice(IO_BACKENDS, "auto is posix; kvikio only when "
                                                          "named"), bad="tape",
           type=_lit(IO_BACKENDS),
           doc="NVMe I/O backend: ``\"posix\"`` (a thread pool doing ``pwritev``/``preadv``), "
           "``\"kvikio\"`` (kvikio's POSIX I/O on the pinned host buffers; needs kvikio and "
           "``libcuda.so.1``) or ``\"aiofiles\"``. ``\"auto\"`` is always ``\"posix\"``: nothing "
           "is measured at run time; on the H200 machine the POSIX pool measured at least as "
           "fast as kvikio at 4 threads, so kvikio is used only when named "
           "(:func:`tiermem.store.io.make_backend` logs the choice)."),
    Option(_S, "io_threads", 4, _int(1, "threads"), bad=0, type="int",
           doc="Threads of the I/O backend."),
    Option(_S, "io_chunk_bytes", "8MiB", _aligned_bytes(4096, "O_DIRECT alignment"), bad=1000,
           type="int | str", doc="Spill I/O is split into chunks of this size (each with its "
           "own checksum), done in parallel."),
    Option(_S, "o_direct", "auto", _choice(AUTO_BOOL, "auto uses O_DIRECT when the filesystem "
                                                      "supports it"), bad="yes",
           type="bool | Literal['auto']", doc="Open spill files with O_DIRECT (``\"auto\"``: "
           "when the filesystem supports it)."),
    Option(_S, "checksum", True, _bool, bad=1, type="bool", doc="Verify a CRC-32C per spill "
           "chunk on read (a corrupted file raises, never returns data)."),
    Option(_S, "policy", "lru", _policy, {"tune": ("lru",)}, users=("api", "loop", "tune"),
           bad="mru", doc="Eviction policy: ``\"lru\"``, ``\"trace\"`` or a "
           ":class:`tiermem.store.policy.Policy` instance."),
    Option(_S, "prefetch_lookahead", 0, _int(0, "accesses looked ahead", "0 turns prefetch off"),
           {"tune": (16,)}, users=("api", "loop", "tune"), bad=-1, type="int",
           doc="Accesses of the recorded step the store looks ahead after each access, "
           "prefetching them into free room (or over keys needed later) with "
           ":class:`tiermem.store.Prefetcher`; 0 turns it off. Needs ``policy=\"trace\"`` (or a "
           "``TracePolicy`` instance)."),
    # ---- budgets: the machine's capacities a run is planned against (loop: null is the
    # planner's default, the H200 machine; tune: None is 3/4 of the no-offload need / none)
    Option(_B, "gpu_bytes", H200_GPU_BYTES, _bytes, {"loop": None, "tune": None},
           users=("loop", "plan", "tune"), bad="lots", type="int | str",
           doc="GPU memory; null: the planner's default (an H200's 141 GB)."),
    Option(_B, "host_bytes", H200_HOST_BYTES, _bytes, {"loop": None, "tune": None},
           users=("loop", "plan", "tune"), bad="lots", type="int | str",
           doc="Host RAM; null: the planner's default (128 GiB)."),
    Option(_B, "nvme_bytes", H200_NVME_BYTES, _bytes, {"loop": None},
           users=("loop", "plan"), bad="lots", type="int | str",
           doc="Disk for spill files; null: the planner's default (64 GiB)."),
    Option(_B, "gpu_reserve_bytes", None, _bytes, none="is 1 GiB + 5 % of the GPU",
           users=("plan",), bad="lots"),
    Option(_B, "host_reserve_bytes", 8 * GiB, _bytes, users=("plan",), bad="lots"),
    # ---- train: the loop of tiermem demo and examples/train_gpt.py (and train_large.py)
    Option(_T, "steps", 30, _int(1), users=("loop",), bad=0, type="int",
           doc="Optimizer steps."),
    Option(_T, "micro_batch", 8, _int(1), users=("loop",), bad=0, type="int",
           doc="Sequences per micro-batch."),
    Option(_T, "grad_accumulation_steps", 1, _int(1), users=_LOOP_PLAN, bad=0, type="int",
           doc="Micro-batches (backward passes) per optimizer step."),
    Option(_T, "seq_len", None, _int(1, "tokens"), none="is the model's", users=("loop",),
           bad=0, type="int", doc="Tokens per sequence; None: the model's ``seq_len``."),
    Option(_T, "dtype", "float32", _dtype(MODEL_DTYPES), users=("loop",), bad="float16",
           type=_lit(MODEL_DTYPES),
           doc="Parameter dtype. float32 compares bit-for-bit with the baseline; bfloat16 keeps "
           "fp32 masters in the optimizer, and the two runs' losses drift apart by rounding "
           "(float16 would need loss scaling and is not offered)."),
    Option(_T, "device", "auto", _device, users=("loop",), bad="tpu", type="str",
           doc="``\"auto\"`` (CUDA if present), ``\"cpu\"``, ``\"cuda\"`` or ``\"cuda:N\"``."),
    Option(_T, "seed", 0, _int(0), users=("loop",), bad=-1, type="int",
           doc="Seed of the model init and of the data."),
    Option(_T, "checkpoint", False, _bool, users=_LOOP_PLAN, bad=1, type="bool",
           doc="Run each block under activation checkpointing (both runs)."),
    Option(_T, "breadth_first_blocks", 0, _blocks_or_auto, users=_LOOP_PLAN, bad=-1,
           type="int | Literal['auto']",
           doc="examples/train_large.py only (``tiermem demo`` takes 0): blocks run for every "
           "micro-batch of a step before the rest of the first one, so the next forward can "
           "start while HybridAdam (``param_sync=\"forward\"``) still steps the later blocks "
           "(Note [breadth-first blocks] in tiermem/schedule/micro_batches.py); 0: "
           "depth-first; ``\"auto\"``: the most that the plan fits on the GPU. Same gradients, "
           "more memory."),
    Option(_T, "baseline", True, _bool, users=("loop",), bad=1, type="bool",
           doc="After the offloaded run, train the same model without offload and compare."),
    Option(_T, "tolerance", 1e-6, _number(0.0), users=("loop",), bad=-1, type="float",
           doc="Largest accepted |loss difference| against the baseline (absolute)."),
    Option(_T, "markov_branching", 4, _int(1), users=("loop",), bad=0, type="int",
           doc="Likely successors per token in the generated Markov chain (lower: easier to "
           "learn)."),
    Option(_T, "log_every", 1, _int(0), users=("loop",), bad=-1, type="int",
           doc="Print the per-step line every N steps (0: never)."),
    Option(_T, "progress", True, _bool, users=("loop",), bad=1, type="bool",
           doc="Show a tqdm progress bar."),
    # ---- streaming: weight streaming of examples/train_large.py (stream_weights' arguments);
    # plan: enabled "auto" streams only when the GPU cannot hold every weight, tier "auto" is
    # RAM if the run fits so, schedule "auto" is block-major (docs/streaming.md)
    Option(_W, "enabled", False, _bool, {"plan-cli": "auto"}, users=_LOOP_PLAN, bad=1,
           type="bool",
           doc="Stream the blocks' weights (False: every weight stays on the GPU)."),
    Option(_W, "tier", "cpu", _choice(STREAM_TIERS, "cpu is pinned RAM, nvme the store's spill "
                                                    "files"), {"plan": "auto"},
           users=_LOOP_PLAN, bad="gpu", type=_lit(STREAM_TIERS),
           doc="The streamed weights' home: ``\"cpu\"`` (the store's pinned RAM) or "
           "``\"nvme\"`` (the store's NVMe tier, read through its RAM staging; needs "
           "store.nvme_bytes and nvme_dir)."),
    Option(_W, "prefetch_blocks", 1, _int(0, "blocks"), users=_LOOP_PLAN, bad=-1, type="int",
           doc="Streamed blocks fetched ahead of the running one (the GPU holds this + 2 "
           "blocks)."),
    Option(_W, "gpu_bytes", None, _bytes, none="is the plan's choice", users=("loop",),
           bad="lots", type="int | str",
           doc="GPU bytes for the blocks' weights: the resident blocks (the last ones that fit) "
           "plus the streaming buffers (Note [resident blocks]); null: the plan's choice "
           "(``tiermem plan``'s ``stream_weights(..., gpu_bytes=...)``)."),
    # Note [NVMe home] in tiermem/stream/nvme_home.py: frozen weights only (a LoRA base);
    # examples/train_large.py trains its streamed weights and refuses it (check_streaming)
    Option(_W, "staging_blocks", None, _int(1, "blocks", "e.g. prefetch_blocks + 2, or {none} "
                                            "for a RAM host copy of every weight"),
           users=("loop",), bad=0, type="int",
           doc="With ``tier: nvme``, keep no RAM copy of the streamed weights: their only home "
           "is NVMe and RAM stages at most this many blocks, read ahead in execution order "
           "(``stream_weights(..., staging_blocks=k)``, Note [NVMe home]); frozen weights "
           "only (a LoRA base: ``examples/train_lora.py --staging-blocks``, whose default is "
           "``prefetch_blocks + 2``). null: a RAM host copy of every streamed weight beside "
           "its NVMe copy (what trained weights need)."),
    Option(_W, "schedule", "block-major", _choice(STREAM_SCHEDULES, "block-major fetches each "
                                                  "streamed block once per pass"),
           {"plan": "auto"}, users=_LOOP_PLAN, bad="random", type=_lit(STREAM_SCHEDULES),
           doc="``\"block-major\"``: each streamed block crosses PCIe once per pass whatever the "
           "number of micro-batches (Note [block-major schedule]); ``\"depth-first\"``: once "
           "per micro-batch."),
    Option(_W, "optimizer", "hybrid", _choice(STREAM_OPTIMIZERS, "hybrid is HybridAdam, torch "
                                              "is torch.optim.AdamW"), users=("loop",),
           bad="sgd", type=_lit(STREAM_OPTIMIZERS),
           doc="The optimizer of examples/train_large.py, with or without streaming: "
           "``\"hybrid\"`` (HybridAdam, the ``optimizer`` section) or ``\"torch\"`` "
           "(torch.optim.AdamW on the parameters, streamed ones on their host copies, with the "
           "section's lr, betas, eps, weight_decay, maximize and max_grad_norm; fp32 moments "
           "only): the phase-1 path of docs/streaming.md and a comparison run."),
]

OPTIONS: dict[str, Option] = {o.dotted: o for o in _FIELDS}
"""Dotted name -> its :class:`Option`, sections in order: the table every user reads (an
option added here reaches them all, tests/test_options.py adds one to show it)."""


def section(name: str, user: str | None = None) -> dict[str, Option]:
    """The options of section ``name`` (field -> Option), in the table's order, those ``user``
    takes when given."""
    return {o.name: o for o in OPTIONS.values()
            if o.section == name and (user is None or user in o.users)}


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


def _staging_rule(who: Who, v: dict) -> None:
    k, tier = v.get("staging_blocks"), v.get("tier", "cpu")
    if k is not None and tier != "nvme":
        raise ValueError(f"{who.prefix}staging_blocks={k} bounds the RAM staging of weights "
                         f"whose only home is NVMe, but {who.name(_W, 'tier')}="
                         f"{short_repr(tier)} keeps every weight in RAM; fix: "
                         f"{who.name(_W, 'tier')}=nvme, or "
                         f"{who.prefix}staging_blocks={who.none}")


RULES: dict[str, dict[str, Callable[[Who, dict], None]]] = {
    _A: {"double_buffering": _double_buffering_rule, "max_kept_bytes": _kept_bytes_rule},
    _S: {"nvme_dir": _spill_dir_rule, "prefetch_lookahead": _lookahead_rule},
    _W: {"staging_blocks": _staging_rule},
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
