"""Typed configuration objects, checked at construction, with YAML files and dotted overrides.

Every config is a keyword-only dataclass; each field's docstring gives its unit and default.
Byte sizes accept ints or strings such as ``"512MiB"`` / ``"4GB"``. Bad values raise
``ValueError``/``TypeError`` at construction naming the field, the value and the fix.

``load_config(path, overrides)`` reads a YAML file into a nested dict, applies Megatron-style
dotted overrides (``optimizer.offload_fraction=0.5``) and returns it; the sections are turned
into the dataclasses below by their users.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from tiermem import _yaml, options
from tiermem.names import MOMENTS_DTYPES, TIERS, check_choice, parse_bytes, parse_dtype, short_repr

__all__ = ["TIERS", "ActivationConfig", "BudgetConfig", "OptimizerConfig", "StoreConfig",
           "TrainConfig", "apply_overrides", "from_dict", "from_tree", "from_yaml", "load_config",
           "parse_bytes"]  # TIERS and parse_bytes live in tiermem.names, re-exported here


_STORE = options.defaults("store", "api")
_OPTIMIZER = options.defaults("optimizer", "loop")
_BUDGETS = options.defaults("budgets", "loop")
_ACTIVATIONS = options.defaults("activations", "loop")
_TRAIN = options.defaults("train", "loop")
"""Each section's defaults, from the one definition (Note [one definition] in
tiermem/options.py): the training loop's where they differ from the APIs'."""


def _check(config: Any, section: str, prefix: str, user: str) -> None:
    """Check and normalize every field of ``config`` (a section's dataclass) and its section's
    rules, as tiermem/options.py defines them (Note [one definition]); messages name the field
    as ``prefix + name`` and spell None ``null`` (the YAML sections), or ``None`` (StoreConfig).

    Raises:
        ValueError, TypeError: a bad value or a broken rule, naming the field and the fix.
    """
    who = options.Who(prefix, "None" if user == "api" else "null")
    for name, value in options.check_section(section, who, vars(config), user).items():
        setattr(config, name, value)


@dataclass(kw_only=True)
class StoreConfig:
    """Configuration of a :class:`tiermem.TierStore`. All budgets are hard limits in bytes."""

    gpu_bytes: int | str = _STORE["gpu_bytes"]
    """Budget of the ``"gpu"`` tier (on a machine without CUDA: a device tier in host memory)."""
    cpu_bytes: int | str = _STORE["cpu_bytes"]
    """Budget of the ``"cpu"`` tier: host memory from the (pinned, when CUDA is there) pool."""
    nvme_bytes: int | str = _STORE["nvme_bytes"]
    """Budget of the ``"nvme"`` tier: bytes of spill-file extents. 0 disables the tier."""
    nvme_dir: str | None = _STORE["nvme_dir"]
    """Base directory for spill files; the store makes a private (0700) subdirectory in it.
    Required when ``nvme_bytes`` > 0."""
    device: str = _STORE["device"]
    """Compute device of the ``"gpu"`` tier: ``"auto"`` (CUDA if present, else CPU), ``"cuda"``,
    ``"cuda:N"`` or ``"cpu"``."""
    pin_memory: bool | Literal["auto"] = _STORE["pin_memory"]
    """Pin the ``"cpu"`` tier's pool (``"auto"``: when the device is CUDA)."""
    pool_slab_bytes: int | str = _STORE["pool_slab_bytes"]
    """Size of one host-pool slab; the pool grows by slabs up to ``cpu_bytes`` and reuses
    freed blocks (pinned allocation costs ~0.5 s/GiB)."""
    io_backend: Literal["auto", "posix", "kvikio", "aiofiles"] = _STORE["io_backend"]
    """NVMe I/O backend: ``"posix"`` (a thread pool doing ``pwritev``/``preadv``), ``"kvikio"``
    (kvikio's POSIX I/O on the pinned host buffers; needs kvikio and ``libcuda.so.1``) or
    ``"aiofiles"``. ``"auto"`` is always ``"posix"``: nothing is measured at run time; on the
    H200 machine the POSIX pool measured at least as fast as kvikio at 4 threads, so kvikio is
    used only when named (:func:`tiermem.store.io.make_backend` logs the choice)."""
    io_threads: int = _STORE["io_threads"]
    """Threads of the I/O backend."""
    io_chunk_bytes: int | str = _STORE["io_chunk_bytes"]
    """Spill I/O is split into chunks of this size (each with its own checksum), done in parallel."""
    o_direct: bool | Literal["auto"] = _STORE["o_direct"]
    """Open spill files with O_DIRECT (``"auto"``: when the filesystem supports it)."""
    checksum: bool = _STORE["checksum"]
    """Verify a CRC-32C per spill chunk on read (a corrupted file raises, never returns data)."""
    policy: Any = _STORE["policy"]
    """Eviction policy: ``"lru"``, ``"trace"`` or a :class:`tiermem.store.policy.Policy` instance."""
    prefetch_lookahead: int = _STORE["prefetch_lookahead"]
    """Accesses of the recorded step the store looks ahead after each access, prefetching them
    into free room (or over keys needed later) with :class:`tiermem.store.Prefetcher`;
    0 turns it off. Needs ``policy="trace"`` (or a ``TracePolicy`` instance)."""

    def __post_init__(self) -> None:
        _check(self, "store", "StoreConfig.", "api")  # Note [one definition]

    def budget(self, tier: str) -> int:
        """Return the byte budget of ``tier``.

        Raises:
            ValueError: unknown tier name.
        """
        check_choice("StoreConfig.budget: ", "tier", tier, TIERS)
        return getattr(self, f"{tier}_bytes")


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply dotted ``section.field=value`` overrides to a nested dict (values parsed as YAML,
    within the bounds of Note [bounded YAML] in tiermem/_yaml.py).

    Raises:
        ValueError: an override without ``=`` or with an empty key, or whose value is not YAML
            or is over a bound (the message names the override, not a file).
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        shown = short_repr(item)
        if not sep or not key.strip():
            raise ValueError(f"override {shown} is not 'section.field=value' "
                             f"(e.g. optimizer.offload_fraction=0.5)")
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {shown}: {short_repr(part)} is a value, not a "
                                 f"section")
        node[parts[-1]] = _override_value(shown, raw) if raw.strip() else None
    return tree


def _override_value(shown: str, raw: str) -> Any:
    """The YAML value of one override (``shown`` names it in messages).

    Raises:
        ValueError: the value is not YAML or is over a bound of Note [bounded YAML].
    """
    try:
        return _yaml.load_text(raw)
    except _yaml.YAMLBoundError as exc:
        raise ValueError(f"override {shown}: the value {exc}; fix: give a plain value") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"override {shown}: the value is not valid YAML ({problem}); fix: "
                         f"complete it (e.g. optimizer.betas=[0.9,0.95]) or quote it") from None
    except ValueError as exc:  # a scalar PyYAML cannot convert, e.g. a 5000-digit int
        raise ValueError(f"override {shown}: the value cannot be read "
                         f"({short_repr(str(exc), 80)}); fix: give a plain value") from None


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> dict:
    """Read a YAML config (or start empty) and apply dotted overrides.

    The file is read within the bounds of Note [bounded YAML] (tiermem/_yaml.py): at most
    1 MiB of UTF-8 text, nesting and aliases bounded.

    Raises:
        FileNotFoundError, IsADirectoryError, PermissionError, OSError: ``path`` cannot be read.
        yaml.YAMLError: the file is not YAML (its marks name the file).
        ValueError: the file is not UTF-8, is over a bound of Note [bounded YAML] or is not a
            YAML mapping (the message names the file), or a malformed override.
    """
    tree: dict = {}
    if path is not None:
        where = f"config file {short_repr(os.fspath(path), 200)}"
        try:
            tree = _yaml.load_text(_yaml.read_file(path), name=os.fspath(path)) or {}
        except _yaml.YAMLBoundError as exc:
            raise _yaml.YAMLBoundError(f"{where} {exc}; fix: write the values out plainly "
                                       f"(a config holds tens of values)") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                             f"fix: save it as UTF-8") from None
        except yaml.YAMLError:
            raise
        except ValueError as exc:  # a scalar PyYAML cannot convert, e.g. a 5000-digit int
            raise ValueError(f"{where}: a value cannot be read ({short_repr(str(exc), 80)}); "
                             f"fix: correct it") from None
        if not isinstance(tree, dict):
            raise ValueError(f"{where} must hold a YAML mapping of sections")
    return apply_overrides(tree, list(overrides))


def _listed(names: list, prefix: str = "", most: int = 8) -> str:
    """``names`` as ``a, b, c`` (each cut to 40 characters; at most ``most`` of them, then a
    count), so a section of 100,000 unknown fields still gives one short line."""
    shown = [prefix + short_repr(n, 40) if not isinstance(n, str) else prefix + n[:40]
             for n in names[:most]]
    rest = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(shown) + rest


def from_dict(cls, section: dict | None, name: str):
    """Build the dataclass ``cls`` from a config section, rejecting unknown fields by name.

    Raises:
        ValueError: a field that ``cls`` does not have (the message lists the valid ones).
    """
    section = dict(section or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - known, key=str)
    if unknown:
        raise ValueError(f"unknown field(s) {_listed(unknown, f'{name}.')}; "
                         f"valid fields of {name}: {', '.join(sorted(known))}")
    return cls(**section)


def from_tree(tree: dict, sections: dict[str, type], *, required: tuple = (),
              where: str = "the config") -> dict[str, Any]:
    """Build each section of a nested dict (a parsed YAML file) into its dataclass.

    Args:
        tree: section name -> mapping of fields.
        sections: section name -> the dataclass it is parsed into (e.g. ``{"store":
            StoreConfig, "optimizer": OptimizerConfig}``); a section left out gets the defaults.
        required: sections that must be present.
        where: what the tree came from, for messages (``"--config='x.yaml'"``).

    Returns:
        section name -> the built dataclass, for every name in ``sections``.

    Raises:
        ValueError: an unknown section or field (the message lists the valid ones), a missing
            required section, or a bad value (naming the field).
        TypeError: ``tree`` or a section is not a mapping, or a value of the wrong type.
    """
    if not isinstance(tree, dict):
        raise TypeError(f"{where} must be a mapping of sections ({', '.join(sections)}), got "
                        f"{type(tree).__name__}")
    unknown = sorted(set(tree) - set(sections), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown section(s) {_listed(unknown)}; valid "
                         f"sections: {', '.join(sections)}")
    for name in required:
        if tree.get(name) is None:
            raise ValueError(f"{where} lacks {name!r} (sections: {', '.join(sections)}); fix: "
                             f"add it")
    out = {}
    for name, cls in sections.items():
        section = tree.get(name)
        if section is not None and not isinstance(section, dict):
            raise TypeError(f"section {name!r} must be a mapping of fields, got "
                            f"{type(section).__name__} {short_repr(section)}")
        out[name] = from_dict(cls, section, name)
    return out


def from_yaml(path: str | os.PathLike, sections: dict[str, type], overrides: list[str] = (),
              *, required: tuple = ()) -> dict[str, Any]:
    """Read a YAML file of sections, apply dotted overrides and build each section.

    Example: ``from_yaml("run.yaml", {"store": StoreConfig, "optimizer": OptimizerConfig})``
    returns ``{"store": StoreConfig(...), "optimizer": OptimizerConfig(...)}``.

    Raises:
        OSError, UnicodeDecodeError, yaml.YAMLError: the file cannot be read or parsed.
        ValueError, TypeError: see :func:`load_config` and :func:`from_tree`.
    """
    return from_tree(load_config(path, overrides), sections, required=required,
                     where=f"config file {short_repr(os.fspath(path))}")


# ------------------------------------------------------------------ training-loop sections
# The sections of examples/train_gpt.py's YAML (and ``tiermem demo``) and of
# examples/train_large.py's presets besides ``store`` (StoreConfig) and ``model``
# (tiermem.models.gpt.GPTConfig). Each mirrors the keyword arguments of the API it feeds, so
# ``HybridAdam(params, **optimizer.kwargs(store=store))`` works.


@dataclass(kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: :class:`tiermem.optim.HybridAdam`'s arguments.

    Every argument of ``HybridAdam`` but ``params`` and the two runtime objects (``store``,
    ``process_group``: pass them to :meth:`kwargs`), with the training loop's defaults (the
    API's differ: see docs/configuration.md). Dtypes take any spelling of
    :data:`tiermem.names.DTYPE_SPELLINGS` (``bf16``, ``bfloat16``, ``torch.bfloat16``, a
    ``torch.dtype``) and are kept by their canonical name.

    Raises:
        ValueError: a value out of range or not one of the choices (naming the field).
        TypeError: a value of the wrong type.
    """

    lr: float = _OPTIMIZER["lr"]
    """Learning rate."""
    betas: tuple[float, float] = _OPTIMIZER["betas"]
    """Coefficients of the running averages of the gradient and its square, each in [0, 1)."""
    eps: float = _OPTIMIZER["eps"]
    """Term added to the denominator."""
    weight_decay: float = _OPTIMIZER["weight_decay"]
    """Weight decay: decoupled (AdamW) with ``adamw``, else an L2 penalty. The examples apply
    it to matrices only (not biases, norms)."""
    adamw: bool = _OPTIMIZER["adamw"]
    """Decoupled weight decay (torch.optim.AdamW) or L2 penalty (torch.optim.Adam)."""
    maximize: bool = _OPTIMIZER["maximize"]
    """Maximize the objective."""
    offload_fraction: float = _OPTIMIZER["offload_fraction"]
    """Fraction of parameter bytes whose fp32 master and moments live off the GPU, in
    [0.0, 1.0]; the last layers go first. 0.0 keeps everything on the GPU."""
    state_tier: Literal["cpu", "nvme", "split"] = _OPTIMIZER["state_tier"]
    """Where offloaded state lives: ``"cpu"`` (pinned RAM), ``"nvme"`` (spill files: needs
    store.nvme_bytes and store.nvme_dir, or ``nvme_dir`` without a store) or ``"split"`` (RAM up
    to the store's cpu budget, the rest on NVMe: needs a store with nvme_bytes)."""
    nvme_dir: str | None = _OPTIMIZER["nvme_dir"]
    """Spill directory of HybridAdam's private store (``state_tier="nvme"`` without a store);
    with a store, set ``store.nvme_dir`` instead."""
    overlap: bool = _OPTIMIZER["overlap"]
    """Step offloaded chunks on the CPU during backward, as their gradients land."""
    chunk_numel: int | None = _OPTIMIZER["chunk_numel"]
    """Elements per offloaded chunk (unit of the CPU step and NVMe I/O), >= 1024; null: sized
    from the model (1/32 of the offloaded elements, within [2^16, 2^24])."""
    max_grad_norm: float | None = _OPTIMIZER["max_grad_norm"]
    """Clip gradients to this global 2-norm inside ``step()``; None: no clipping."""
    grad_accumulation_steps: int | None = _OPTIMIZER["grad_accumulation_steps"]
    """Backward passes per ``step()``; null: the training loop's count (both examples pass
    ``train.grad_accumulation_steps``; set it here only where nothing else does)."""
    moments_dtype: Literal["float32", "bfloat16"] = _OPTIMIZER["moments_dtype"]
    """Dtype of the Adam moments, on the GPU side and the offloaded side alike: ``"float32"``
    (exact torch semantics; 12 bytes of offloaded state per param, 8 on the GPU side plus 4 for
    the fp32 master of a non-fp32 param) or ``"bfloat16"`` (8 bytes per offloaded param, 4 + 4
    on the GPU side; moments rounded to bf16 after each update). Masters stay fp32."""
    cpu_threads: int | None = _OPTIMIZER["cpu_threads"]
    """Threads of the CPU step; None: torch's thread count (less one with overlap on CUDA)."""
    nvme_lookahead_chunks: int = _OPTIMIZER["nvme_lookahead_chunks"]
    """Chunks of NVMe-resident state read ahead of the CPU step (``state_tier="nvme"``)."""
    data_parallel: bool | None = _OPTIMIZER["data_parallel"]
    """Shard the state across the ranks (ZeRO-1/2); null: on when a process group is passed."""
    bucket_numel: int = _OPTIMIZER["bucket_numel"]
    """Elements per gradient-reduce bucket with ``data_parallel``."""
    param_sync: Literal["step", "forward"] = _OPTIMIZER["param_sync"]
    """When the updated offloaded params are waited for: in ``step()`` or in the next forward."""
    placement: Literal["trace", "given"] = _OPTIMIZER["placement"]
    """Which elements keep their state on the GPU: by the first backward's gradient order
    (``"trace"``) or by the order the params were given in (``"given"``)."""
    gpu_step_fraction: float = _OPTIMIZER["gpu_step_fraction"]
    """Share of the offloaded chunks the GPU steps by streaming their state through it, in
    [0.0, 1.0] (1.0 is fastest at full offload when PCIe is not busy with activations)."""
    rollback_bytes: int | str = _OPTIMIZER["rollback_bytes"]
    """Host RAM (bytes or ``"4GiB"``) for pre-step copies of chunk state: with
    ``max_grad_norm`` chunks step during backward and are rolled back when the norm clips
    (Note [speculative step] in tiermem/optim/speculate.py); 0: they wait for the norm."""

    def __post_init__(self) -> None:
        _check(self, "optimizer", "optimizer.", "loop")  # Note [one definition]

    def kwargs(self, *, store: Any = None, process_group: Any = None,
               grad_accumulation_steps: int | None = None) -> dict:
        """Keyword arguments for ``HybridAdam(params, **kwargs)``: every field (``moments_dtype``
        as a ``torch.dtype``; ``grad_accumulation_steps`` only when set here or passed) plus the
        runtime arguments given (``None``: left out).

        Args:
            store: the TierStore for the offloaded state.
            process_group: the data-parallel group.
            grad_accumulation_steps: the training loop's backward passes per step; used when
                the section leaves ``grad_accumulation_steps`` null.

        Raises:
            ValueError: ``grad_accumulation_steps`` set here and passed with another value, or
                ``nvme_dir`` set here together with a ``store`` (which has its own).
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["moments_dtype"] = parse_dtype("optimizer.", "moments_dtype", self.moments_dtype,
                                           MOMENTS_DTYPES)
        steps = self.grad_accumulation_steps
        if steps is not None and grad_accumulation_steps not in (None, steps):
            raise ValueError(f"optimizer.grad_accumulation_steps={steps} but the training loop "
                             f"runs {grad_accumulation_steps} backward passes per step; fix: set "
                             f"it in one place (train.grad_accumulation_steps in the examples)")
        steps = steps if steps is not None else grad_accumulation_steps
        if steps is None:
            del out["grad_accumulation_steps"]
        else:
            out["grad_accumulation_steps"] = steps
        if store is not None and self.nvme_dir is not None:
            raise ValueError(f"optimizer.nvme_dir={short_repr(self.nvme_dir)} is for "
                             f"HybridAdam's private store, but a store is given; fix: set "
                             f"store.nvme_dir instead")
        for name, value in (("store", store), ("process_group", process_group)):
            if value is not None:
                out[name] = value
        return out


@dataclass(kw_only=True)
class BudgetConfig:
    """The ``budgets`` section (examples/train_large.py): the machine's capacities that
    :func:`tiermem.apps.plan.plan` checks a run against, in bytes (ints or ``"141GB"``).

    Raises:
        ValueError, TypeError: a size that is not a byte count (naming the field).
    """

    gpu_bytes: int | str | None = _BUDGETS["gpu_bytes"]
    """GPU memory; null: the planner's default (an H200's 141 GB)."""
    host_bytes: int | str | None = _BUDGETS["host_bytes"]
    """Host RAM; null: the planner's default (128 GiB)."""
    nvme_bytes: int | str | None = _BUDGETS["nvme_bytes"]
    """Disk for spill files; null: the planner's default (64 GiB)."""

    def __post_init__(self) -> None:
        _check(self, "budgets", "budgets.", "loop")  # Note [one definition]

    def kwargs(self) -> dict:
        """Keyword arguments for :func:`tiermem.apps.plan.plan`: the capacities set (bytes)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(kw_only=True)
class ActivationConfig:
    """The ``activations`` section: :func:`tiermem.offload.offload_activations`'s arguments."""

    enabled: bool = _ACTIVATIONS["enabled"]
    """Offload saved activations at all (False: they stay on the device)."""
    tier: Literal["cpu", "nvme"] = _ACTIVATIONS["tier"]
    """``"cpu"`` (pinned host memory) or ``"nvme"`` (needs store.nvme_bytes and nvme_dir)."""
    num_layers: int | None = _ACTIVATIONS["num_layers"]
    """Offload the first N blocks, in [0, n_layers); None: chosen by measurement (``layers="auto"``:
    the blocks whose copies hide behind compute, see ``offload_activations``)."""
    prefetch_depth: int = _ACTIVATIONS["prefetch_depth"]
    """Layers reloaded ahead of the one backward is in (>= 1)."""
    min_offload_bytes: int = _ACTIVATIONS["min_offload_bytes"]
    """Saved tensors smaller than this many bytes stay on the device."""
    offload_weights: bool = _ACTIVATIONS["offload_weights"]
    """Also offload parameters and buffers that autograd saves."""
    double_buffering: bool = _ACTIVATIONS["double_buffering"]
    """Reload into two persistent device buffer sets (needs prefetch_depth=1)."""
    max_kept_bytes: int | str | None = _ACTIVATIONS["max_kept_bytes"]
    """With num_layers null: at most this many bytes of block activations stay on the device
    (``"8GiB"``); null: bounded by the device memory left unused (CUDA) or not at all (CPU)."""

    def __post_init__(self) -> None:
        _check(self, "activations", "activations.", "loop")  # Note [one definition]

    def kwargs(self) -> dict:
        """Keyword arguments for ``offload_activations`` (everything but blocks and store)."""
        out = dataclasses.asdict(self)
        del out["enabled"]
        return out


@dataclass(kw_only=True)
class TrainConfig:
    """The ``train`` section: the loop of examples/train_gpt.py and ``tiermem demo``."""

    steps: int = _TRAIN["steps"]
    """Optimizer steps."""
    micro_batch: int = _TRAIN["micro_batch"]
    """Sequences per micro-batch."""
    grad_accumulation_steps: int = _TRAIN["grad_accumulation_steps"]
    """Micro-batches (backward passes) per optimizer step."""
    seq_len: int | None = _TRAIN["seq_len"]
    """Tokens per sequence; None: the model's ``seq_len``."""
    dtype: Literal["float32", "bfloat16"] = _TRAIN["dtype"]
    """Parameter dtype. float32 compares bit-for-bit with the baseline; bfloat16 keeps fp32
    masters in the optimizer, and the two runs' losses drift apart by rounding (float16 would
    need loss scaling and is not offered)."""
    device: str = _TRAIN["device"]
    """``"auto"`` (CUDA if present), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    seed: int = _TRAIN["seed"]
    """Seed of the model init and of the data."""
    checkpoint: bool = _TRAIN["checkpoint"]
    """Run each block under activation checkpointing (both runs)."""
    breadth_first_blocks: int | Literal["auto"] = _TRAIN["breadth_first_blocks"]
    """examples/train_large.py only (``tiermem demo`` takes 0): blocks run for every
    micro-batch of a step before the rest of the first one, so the next forward can start while
    HybridAdam (``param_sync="forward"``) still steps the later blocks (Note [breadth-first
    blocks] in tiermem/schedule/micro_batches.py); 0: depth-first; ``"auto"``: the most that
    the plan fits on the GPU. Same gradients, more memory."""
    baseline: bool = _TRAIN["baseline"]
    """After the offloaded run, train the same model without offload and compare."""
    tolerance: float = _TRAIN["tolerance"]
    """Largest accepted |loss difference| against the baseline (absolute)."""
    markov_branching: int = _TRAIN["markov_branching"]
    """Likely successors per token in the generated Markov chain (lower: easier to learn)."""
    log_every: int = _TRAIN["log_every"]
    """Print the per-step line every N steps (0: never)."""
    progress: bool = _TRAIN["progress"]
    """Show a tqdm progress bar."""

    def __post_init__(self) -> None:
        _check(self, "train", "train.", "loop")  # Note [one definition]


# ------------------------------------------------------------------ weight streaming (issue 29)
STREAM_TIERS, STREAM_SCHEDULES, STREAM_OPTIMIZERS = (
    options.STREAM_TIERS, options.STREAM_SCHEDULES, options.STREAM_OPTIMIZERS)
_STREAMING = options.defaults("streaming", "loop")


@dataclass(kw_only=True)
class StreamingConfig:
    """The ``streaming`` section (examples/train_large.py): weight streaming of the model's
    blocks, :func:`tiermem.stream.stream_weights`'s arguments (docs/streaming.md). Dotted
    overrides as for every section: ``streaming.enabled=true streaming.tier=nvme``.

    Raises:
        ValueError, TypeError: a bad value, naming the field and the fix.
    """

    enabled: bool = _STREAMING["enabled"]
    """Stream the blocks' weights (False: every weight stays on the GPU)."""
    tier: Literal["cpu", "nvme"] = _STREAMING["tier"]
    """The streamed weights' home: ``"cpu"`` (the store's pinned RAM) or ``"nvme"`` (the
    store's NVMe tier, read through its RAM staging; needs store.nvme_bytes and nvme_dir)."""
    prefetch_blocks: int = _STREAMING["prefetch_blocks"]
    """Streamed blocks fetched ahead of the running one (the GPU holds this + 2 blocks)."""
    gpu_bytes: int | str | None = _STREAMING["gpu_bytes"]
    """GPU bytes for the blocks' weights: the resident blocks (the last ones that fit) plus the
    streaming buffers (Note [resident blocks]); null: the plan's choice (``tiermem plan``'s
    ``stream_weights(..., gpu_bytes=...)``)."""
    schedule: Literal["block-major", "depth-first"] = _STREAMING["schedule"]
    """``"block-major"``: each streamed block crosses PCIe once per pass whatever the number of
    micro-batches (Note [block-major schedule]); ``"depth-first"``: once per micro-batch."""
    optimizer: Literal["hybrid", "torch"] = _STREAMING["optimizer"]
    """The optimizer of examples/train_large.py, with or without streaming: ``"hybrid"``
    (HybridAdam, the ``optimizer`` section) or ``"torch"`` (torch.optim.AdamW on the
    parameters, streamed ones on their host copies, with the section's lr, betas, eps,
    weight_decay, maximize and max_grad_norm; fp32 moments only): the phase-1 path of
    docs/streaming.md and a comparison run."""

    def __post_init__(self) -> None:
        _check(self, "streaming", "streaming.", "loop")  # Note [one definition]
