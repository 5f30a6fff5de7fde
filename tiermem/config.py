"""Typed configuration objects, checked at construction, with YAML files and dotted overrides.

Every config is a keyword-only dataclass whose fields come from tiermem/options.py (Note
[fields from the table]); each class's docstring lists its fields with their unit and default.
Byte sizes accept ints or strings such as ``"512MiB"`` / ``"4GB"``. Bad values raise
``ValueError``/``TypeError`` at construction naming the field, the value and the fix.

``load_config(path, overrides)`` reads a YAML file into a nested dict, applies Megatron-style
dotted overrides (``optimizer.offload_fraction=0.5``) and returns it; the sections are turned
into the dataclasses below by their users.
"""

from __future__ import annotations

import dataclasses
import os
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Literal  # noqa: F401 - Literal: the fields' annotations

import yaml

from tiermem import _yaml, options
from tiermem.names import MOMENTS_DTYPES, TIERS, check_choice, parse_bytes, parse_dtype, short_repr

__all__ = ["TIERS", "ActivationConfig", "BudgetConfig", "OptimizerConfig", "StoreConfig",
           "TrainConfig", "apply_overrides", "from_dict", "from_tree", "from_yaml", "load_config",
           "parse_bytes"]  # TIERS and parse_bytes live in tiermem.names, re-exported here


def _from_table(section: str, user: str, prefix: str) -> Callable[[type], type]:
    """The class decorator that makes ``cls`` the keyword-only dataclass of ``section``, its
    fields read from tiermem/options.py for ``user``.

    Note [fields from the table]: a section's dataclass declares no field; this decorator
    gives it one per option of the section that ``user`` takes (:func:`tiermem.options.section`),
    in the table's order, with ``user``'s default (:meth:`~tiermem.options.Option.default_for`),
    the option's annotation (:meth:`~tiermem.options.Option.annotation`, a string as
    ``from __future__ import annotations`` keeps it) and its doc and dotted name in the field's
    ``metadata``; a ``__post_init__`` that checks every field and the section's rules
    (Note [one definition]); and a ``Fields:`` list in the class docstring, for ``help()`` and
    the IDEs (the fields have no source line to jump to; ``inspect.signature`` shows them
    typed). Then ``dataclasses.dataclass(kw_only=True)`` makes the class as a hand-written one:
    the same ``__init__``, ``repr``, ``==`` and ``dataclasses.fields``. So an option added to
    the table appears in its section's class with nothing written here (tests/test_options.py
    builds a class from a table with one option more).

    Raises:
        TypeError: ``cls`` defines a name the table makes a field (rename the method).
    """
    def build(cls: type) -> type:
        table = options.section(section, user)
        clash = sorted(set(table) & set(vars(cls)))
        if clash:
            raise TypeError(f"{cls.__name__} defines {', '.join(clash)}, which "
                            f"tiermem/options.py makes fields of {section!r}; fix: rename it "
                            f"(Note [fields from the table])")
        cls.__annotations__ = {name: o.annotation(user) for name, o in table.items()}
        for name, option in table.items():
            setattr(cls, name, dataclasses.field(
                default=option.default_for(user),
                metadata={"dotted": option.dotted, "doc": option.doc}))

        def __post_init__(self) -> None:
            _check(self, section, prefix, user)  # Note [one definition]

        __post_init__.__qualname__ = f"{cls.__qualname__}.__post_init__"
        cls.__post_init__ = __post_init__
        cls.__doc__ = (cls.__doc__ or "").rstrip() + _fields_doc(table, user)
        return dataclass(kw_only=True)(cls)
    return build


def _fields_doc(table: dict[str, options.Option], user: str) -> str:
    """The ``Fields:`` paragraph of a section's docstring: each field with its annotation,
    default and doc (Note [fields from the table])."""
    lines = ["", "", "    Fields (tiermem/options.py, Note [fields from the table]):"]
    for name, option in table.items():
        head = f"{name} ({option.annotation(user)}, default {option.default_for(user)!r}): "
        lines.append(textwrap.fill(head + option.doc, width=96, initial_indent=" " * 8,
                                   subsequent_indent=" " * 12))
    return "\n".join(lines) + "\n    "


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


@_from_table("store", "api", "StoreConfig.")
class StoreConfig:
    """Configuration of a :class:`tiermem.TierStore`. All budgets are hard limits in bytes.

    The fields are the ``store`` options of tiermem/options.py with the library's defaults
    (Note [fields from the table]), listed below.

    Raises:
        ValueError, TypeError: a bad value or a broken rule, naming the field and the fix.
    """

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


@_from_table("optimizer", "loop", "optimizer.")
class OptimizerConfig:
    """The ``optimizer`` section: :class:`tiermem.optim.HybridAdam`'s arguments.

    Every argument of ``HybridAdam`` but ``params`` and the two runtime objects (``store``,
    ``process_group``: pass them to :meth:`kwargs`), with the training loop's defaults (the
    API's differ: see docs/configuration.md). The fields are the ``optimizer`` options of
    tiermem/options.py (Note [fields from the table]), listed below. Dtypes take any spelling
    of :data:`tiermem.names.DTYPE_SPELLINGS` (``bf16``, ``bfloat16``, ``torch.bfloat16``, a
    ``torch.dtype``) and are kept by their canonical name.

    Raises:
        ValueError: a value out of range or not one of the choices (naming the field).
        TypeError: a value of the wrong type.
    """

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


@_from_table("budgets", "loop", "budgets.")
class BudgetConfig:
    """The ``budgets`` section (examples/train_large.py): the machine's capacities that
    :func:`tiermem.apps.plan.plan` checks a run against, in bytes (ints or ``"141GB"``). The
    fields are the ``budgets`` options of tiermem/options.py the training loop takes
    (Note [fields from the table]), listed below.

    Raises:
        ValueError, TypeError: a size that is not a byte count (naming the field).
    """

    def kwargs(self) -> dict:
        """Keyword arguments for :func:`tiermem.apps.plan.plan`: the capacities set (bytes)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@_from_table("activations", "loop", "activations.")
class ActivationConfig:
    """The ``activations`` section: :func:`tiermem.offload.offload_activations`'s arguments.
    The fields are the ``activations`` options of tiermem/options.py (Note [fields from the
    table]), listed below.

    Raises:
        ValueError, TypeError: a bad value or a broken rule, naming the field and the fix.
    """

    def kwargs(self) -> dict:
        """Keyword arguments for ``offload_activations`` (everything but blocks and store)."""
        out = dataclasses.asdict(self)
        del out["enabled"]
        return out


@_from_table("train", "loop", "train.")
class TrainConfig:
    """The ``train`` section: the loop of examples/train_gpt.py and ``tiermem demo``. The
    fields are the ``train`` options of tiermem/options.py (Note [fields from the table]),
    listed below.

    Raises:
        ValueError, TypeError: a bad value, naming the field and the fix.
    """


# ------------------------------------------------------------------ weight streaming (issue 29)
STREAM_TIERS, STREAM_SCHEDULES, STREAM_OPTIMIZERS = (
    options.STREAM_TIERS, options.STREAM_SCHEDULES, options.STREAM_OPTIMIZERS)


@_from_table("streaming", "loop", "streaming.")
class StreamingConfig:
    """The ``streaming`` section (examples/train_large.py): weight streaming of the model's
    blocks, :func:`tiermem.stream.stream_weights`'s arguments (docs/streaming.md). Dotted
    overrides as for every section: ``streaming.enabled=true streaming.tier=nvme``. The fields
    are the ``streaming`` options of tiermem/options.py (Note [fields from the table]), listed
    below.

    Raises:
        ValueError, TypeError: a bad value, naming the field and the fix.
    """
