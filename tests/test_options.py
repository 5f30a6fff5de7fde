"""Note [one definition] (tiermem/options.py): every user of a configuration field takes its
default and its check from the field's one definition; these tests walk every user (the YAML
sections' dataclasses, HybridAdam, offload_activations, StoreConfig, plan(), and the flags of
tiermem plan, tiermem tune and examples/train_large.py) and fail when one drifts.

The checks are proved to come from the definition by swapping each field's check for one that
raises a marked error: every user must then raise it (a user with its own copy of the check
would not)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import logging
import pathlib
import re
import typing

import pytest
import torch

from _examples import load_example
from tiermem import config, flags, options
from tiermem.offload import offload_activations
from tiermem.offload.activations import ActivationOffloader
from tiermem.offload.tensors import offload_tensors
from tiermem.optim import HybridAdam
from tiermem.apps.plan import plan
from tiermem.apps.plan import placement
from tiermem.apps.plan.cli import build_parser as plan_parser, main as plan_main
from tiermem.apps.tune.cli import _parse_args as tune_args
from tiermem.apps import cli
from tiermem.apps.demo import build_parser as demo_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = {"store": config.StoreConfig, "optimizer": config.OptimizerConfig,
            "activations": config.ActivationConfig, "train": config.TrainConfig,
            "budgets": config.BudgetConfig, "streaming": config.StreamingConfig}
"""Section -> the dataclass its YAML section is read into."""
SECTION_USER = {"store": "api"}
"""The user whose defaults a section's dataclass takes (the training loop's, but StoreConfig:
the library's, which TierStore builds from)."""

SAMPLE = {  # a good value for the fields whose default is None, "auto" or a grid
    "optimizer.offload_fraction": 0.5, "optimizer.state_tier": "cpu",
    "optimizer.nvme_dir": "/tmp", "optimizer.chunk_numel": 4096, "optimizer.max_grad_norm": 1.0,
    "optimizer.grad_accumulation_steps": 2, "optimizer.cpu_threads": 1,
    "optimizer.data_parallel": False, "optimizer.prefetch_depth": 1,
    "activations.num_layers": 0, "activations.max_kept_bytes": 4096,
    "activations.prefetch_depth": 1, "store.nvme_dir": "/tmp", "store.policy": "lru",
    "store.prefetch_lookahead": 0, "budgets.gpu_bytes": "1GiB", "budgets.host_bytes": "1GiB",
    "budgets.nvme_bytes": "1GiB", "budgets.gpu_reserve_bytes": "1GiB",
    "train.seq_len": 8, "streaming.enabled": True, "streaming.tier": "cpu",
    "streaming.schedule": "block-major", "streaming.gpu_bytes": "1GiB",
    "streaming.staging_blocks": 2,
}


def value_for(option: options.Option, user: str):
    """A value ``user`` accepts for ``option`` that reaches its check (not None, not "auto")."""
    value = option.default_for(user)
    if (value is None or (value == "auto" and option.dotted in SAMPLE)
            or (user == "tune" and isinstance(value, tuple))):
        return SAMPLE[option.dotted]
    return value


class Marked(ValueError):
    """The error of a swapped check."""


@contextlib.contextmanager
def marked_check(option: options.Option):
    """``option``'s check raises :class:`Marked` naming it, inside the block."""
    original = option.check

    def check(who, name, value):
        raise Marked(f"marked check of {option.dotted}")

    object.__setattr__(option, "check", check)
    try:
        yield f"marked check of {option.dotted}"
    finally:
        object.__setattr__(option, "check", original)


def keywords(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


# ------------------------------------------------------------------ the table itself


def test_every_option_names_known_users_and_refuses_its_bad_value():
    for dotted, option in options.OPTIONS.items():
        assert set(option.users) <= set(options.USERS), dotted
        assert set(option.defaults) <= set(options.USERS), dotted
        if option.bad is not None:
            with pytest.raises((ValueError, TypeError)) as err:
                option(options.Who("x."), option.bad)
            assert str(err.value).startswith(f"x.{option.name}"), str(err.value)


# ------------------------------------------------------------------ the YAML sections


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_each_section_dataclass_has_the_fields_and_defaults_of_its_definition(section):
    user = SECTION_USER.get(section, "loop")
    fields = [(f.name, f.default, f.type) for f in dataclasses.fields(SECTIONS[section])]
    table = options.section(section, user)
    assert fields == [(n, o.default_for(user), o.annotation(user)) for n, o in table.items()]
    hints = typing.get_type_hints(SECTIONS[section])  # the annotations resolve
    assert list(hints) == list(table)
    for name in table:  # help() and the IDEs see each field in the class docstring
        assert f"\n        {name} (" in SECTIONS[section].__doc__, (section, name)


def _with_option(monkeypatch, option: options.Option) -> None:
    """The table with ``option`` added at its end, for the rest of the test (a copy: the
    table's order is the fields' order, and must come back as it was)."""
    monkeypatch.setattr(options, "OPTIONS", {**options.OPTIONS, option.dotted: option})


NEW_KNOB = options.Option("optimizer", "new_knob", 7, options._int(1, "widgets"),
                          {"loop": 3}, bad=0, type="int", doc="Widgets per step (a test field).")
"""An optimizer option that no code knows: added to the table, it must reach the section's
class (Note [fields from the table] in tiermem/config.py)."""


def _fresh_optimizer_config() -> type:
    """A class built as tiermem/config.py builds OptimizerConfig, from the table as it is now."""
    body = {"__doc__": "The optimizer section (a test copy).",
            "kwargs": config.OptimizerConfig.kwargs, "__module__": __name__}
    return config._from_table("optimizer", "loop", "optimizer.")(
        type("OptimizerConfig", (), body))


def test_the_section_class_built_from_the_table_is_optimizer_config():
    fresh = _fresh_optimizer_config()
    same = [(f.name, f.type, f.default, f.kw_only) for f in dataclasses.fields(fresh)]
    assert same == [(f.name, f.type, f.default, f.kw_only)
                    for f in dataclasses.fields(config.OptimizerConfig)]
    assert repr(fresh(lr=0.5)) == repr(config.OptimizerConfig(lr=0.5))
    assert str(inspect.signature(fresh)) == str(inspect.signature(config.OptimizerConfig))


def test_an_option_added_to_the_table_appears_in_optimizer_config(monkeypatch, tmp_path):
    before = [f.name for f in dataclasses.fields(config.OptimizerConfig)]
    _with_option(monkeypatch, NEW_KNOB)
    cls = _fresh_optimizer_config()
    assert [f.name for f in dataclasses.fields(cls)] == before + ["new_knob"]
    field = dataclasses.fields(cls)[-1]
    assert (field.type, field.default, field.metadata["doc"]) == ("int", 3, NEW_KNOB.doc)
    assert "new_knob (int, default 3): Widgets per step" in cls.__doc__
    assert cls().new_knob == 3 and cls(new_knob=5) != cls()
    assert "new_knob=3" in repr(cls())
    with pytest.raises(ValueError, match=r"^optimizer\.new_knob=0 "):  # the table's check
        cls(new_knob=0)
    # YAML and dotted overrides reach it as every field
    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  new_knob: 4\n")
    built = config.from_yaml(path, {"optimizer": cls}, ["optimizer.lr=0.25"])["optimizer"]
    assert (built.new_knob, built.lr) == (4, 0.25)
    built = config.from_yaml(path, {"optimizer": cls}, ["optimizer.new_knob=9"])["optimizer"]
    assert built.new_knob == 9
    assert built.kwargs()["new_knob"] == 9  # and on to HybridAdam(**kwargs)


def test_a_method_named_as_a_field_is_refused():
    body = {"lr": lambda self: 0.0}
    with pytest.raises(TypeError, match=r"defines lr, which tiermem/options.py makes fields"):
        config._from_table("optimizer", "loop", "optimizer.")(type("Bad", (), body))


@pytest.mark.parametrize("dotted", [d for d, o in options.OPTIONS.items()
                                    if o.section in SECTIONS
                                    and SECTION_USER.get(o.section, "loop") in o.users])
def test_each_section_dataclass_checks_with_the_definition(dotted):
    option = options.OPTIONS[dotted]
    user = SECTION_USER.get(option.section, "loop")
    with marked_check(option) as mark, pytest.raises(Marked, match=mark):
        SECTIONS[option.section](**{option.name: value_for(option, user)})


# ------------------------------------------------------------------ the APIs

API_FUNCTIONS = {
    "optimizer": [(HybridAdam.__init__, {"self", "params", "store", "process_group"})],
    "activations": [(offload_activations, {"blocks", "store", "layers"}),
                    (ActivationOffloader.__init__, {"self", "blocks", "store", "layers"}),
                    (offload_tensors, {"store"})],
}
"""Section -> the API functions taking its fields, each with its keywords that are no field
(runtime objects)."""


@pytest.mark.parametrize("section", sorted(API_FUNCTIONS))
def test_every_api_keyword_is_a_field_with_its_default(section):
    for fn, runtime in API_FUNCTIONS[section]:
        params = keywords(fn)
        fields = options.section(section, "api")
        for name, param in params.items():
            if name in runtime:
                continue
            assert name in fields, f"{fn.__qualname__}({name}=...) is no {section} field"
            assert param.default == fields[name].default, (fn.__qualname__, name)
    # and HybridAdam takes every optimizer field the library's users take
    assert set(options.section("optimizer", "api")) <= set(keywords(HybridAdam.__init__))


HYBRID_ADAM_RUNTIME = {"self", "params", "store", "process_group"}
"""HybridAdam's keywords that are runtime objects, no configuration field."""


def _hybrid_adam_drift() -> list[str]:
    """What differs between HybridAdam's keywords and the optimizer options of the table."""
    taken = set(keywords(HybridAdam.__init__)) - HYBRID_ADAM_RUNTIME
    api, loop = set(options.section("optimizer", "api")), set(options.section("optimizer", "loop"))
    return ([f"HybridAdam({k}=...) is not defined in tiermem/options.py" for k in
             sorted(taken - api)]
            + [f"optimizer.{k} is defined but HybridAdam does not take it" for k in
               sorted((api | loop) - taken)])


def test_hybrid_adam_takes_exactly_the_optimizer_options():
    assert _hybrid_adam_drift() == []
    # and OptimizerConfig (built from the table) hands every one of them to HybridAdam
    assert set(config.OptimizerConfig().kwargs(grad_accumulation_steps=1)) == (
        set(keywords(HybridAdam.__init__)) - HYBRID_ADAM_RUNTIME)


def test_the_hybrid_adam_drift_check_sees_either_side(monkeypatch):
    _with_option(monkeypatch, NEW_KNOB)  # defined, not taken
    assert _hybrid_adam_drift() == ["optimizer.new_knob is defined but HybridAdam does not "
                                    "take it"]
    monkeypatch.setattr(options, "OPTIONS", {d: o for d, o in options.OPTIONS.items() if d not in
                                             ("optimizer.new_knob", "optimizer.placement")})
    # placement: taken, not defined
    assert _hybrid_adam_drift() == ["HybridAdam(placement=...) is not defined in "
                                    "tiermem/options.py"]


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


@pytest.mark.parametrize("dotted", [d for d, o in options.OPTIONS.items()
                                    if o.section == "optimizer" and "api" in o.users])
def test_hybrid_adam_checks_each_field_with_the_definition(dotted):
    option = options.OPTIONS[dotted]
    with marked_check(option) as mark, pytest.raises(Marked, match=mark):
        HybridAdam(_tiny().parameters(), **{option.name: value_for(option, "api")})


@pytest.mark.parametrize("name", sorted(set(keywords(offload_activations)) - {"blocks", "store",
                                                                              "layers"}))
def test_offload_activations_checks_each_field_with_the_definition(name):
    option = options.OPTIONS[f"activations.{name}"]
    if name == "num_layers":  # checked against the blocks (resolve_layers) and the rule
        option = None
    if option is None:
        return
    with marked_check(option) as mark, pytest.raises(Marked, match=mark):
        offload_activations(_tiny(), **{name: value_for(option, "api")})


@pytest.mark.parametrize("name", sorted(options.section("store", "api")))
def test_store_config_checks_each_field_with_the_definition(name):
    option = options.OPTIONS[f"store.{name}"]
    with marked_check(option) as mark, pytest.raises(Marked, match=mark):
        config.StoreConfig(**{name: value_for(option, "api")})


# ------------------------------------------------------------------ plan()


def test_every_plan_keyword_is_a_field_with_its_default_or_named_as_none():
    params = keywords(plan)
    assert set(params) == set(placement.FIELDS) | set(placement.NOT_FIELDS)
    for keyword, dotted in placement.FIELDS.items():
        option = options.OPTIONS[dotted]
        assert "plan" in option.users, dotted
        assert params[keyword].default == option.default_for("plan"), keyword


@pytest.mark.parametrize("keyword", sorted(placement.FIELDS))
def test_plan_checks_each_keyword_with_the_definition(keyword):
    option = options.OPTIONS[placement.FIELDS[keyword]]
    with marked_check(option) as mark, pytest.raises(Marked, match=mark):
        plan(13e9, n_layers=40, d_model=5120, **{keyword: value_for(option, "plan")})


# ------------------------------------------------------------------ the command-line flags


def _train_large():
    return load_example("train_large")


def _tune_parser_flags() -> dict:
    """tiermem tune's flags (option string -> argparse action), read from its parser."""
    import argparse
    seen = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        seen.update({s: a for a in self._actions for s in a.option_strings})
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_args = capture
    try:
        tune_args([])
    finally:
        argparse.ArgumentParser.parse_args = original
    return seen


class _Parser(BaseException):
    """Raised from ``parse_args`` to hand the test the parser (and run nothing more)."""

    def __init__(self, parser):
        super().__init__("parser")
        self.parser = parser


def _parser_of(command: str):
    """The argparse parser of ``tiermem bench NAME`` or ``tiermem demo``, read from the call
    that parses its flags (the bench runs nothing: its parse_args raises :class:`_Parser`)."""
    if command == "demo":
        return demo_parser()
    module = importlib.import_module(cli.BENCHES[command.removeprefix("bench ")])
    entry = getattr(module, "_parse_args", None) or module.main

    def capture(self, args=None, namespace=None):
        raise _Parser(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = capture
    try:
        entry([])
    except _Parser as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{command} parsed no flags")


APP_COMMANDS = [f"bench {name}" for name in sorted(cli.BENCHES)] + ["demo"]
"""The applications' commands whose flags Note [which flags map] (tiermem/flags.py) sorts."""


def _flags_of(command: str) -> dict:
    if command == "plan":
        return {s: a for a in plan_parser()._actions for s in a.option_strings}
    if command == "tune":
        return _tune_parser_flags()
    if command in APP_COMMANDS:
        return {s: a for a in _parser_of(command)._actions for s in a.option_strings}
    help_text = _train_large_help()
    return dict.fromkeys(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", help_text))


def _train_large_help() -> str:
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        _train_large().main(["--help"])
    return out.getvalue()


@pytest.mark.parametrize("command", sorted(set(flags.FLAGS) | set(APP_COMMANDS)))
def test_every_flag_is_a_field_an_alias_or_named_as_none(command):
    found = set(_flags_of(command)) - {"--help", "-h"}
    mapped, aliases = set(flags.FLAGS.get(command, {})), set(flags.ALIASES.get(command, {}))
    unmapped = set(flags.UNMAPPED.get(command, {}))
    assert not mapped & unmapped and not aliases & (mapped | unmapped)
    if command == "train_large":  # the help lists no suppressed alias
        found |= aliases
    assert found == mapped | aliases | unmapped, (
        f"not in tiermem/flags.py: {sorted(found - mapped - aliases - unmapped)}; "
        f"not in the parser: {sorted((mapped | aliases | unmapped) - found)}")
    for old, new in flags.ALIASES.get(command, {}).items():
        assert new in mapped, (old, new)


@pytest.mark.parametrize("command", ["plan", "tune"])
def test_each_flag_defaults_to_its_field(command):
    actions = _flags_of(command)
    for flag in flags.FLAGS[command]:
        want = flags.default(command, flag)
        want = list(want) if isinstance(want, tuple) else want
        assert actions[flag].default == want, (command, flag)
        for old, new in flags.ALIASES.get(command, {}).items():
            if new == flag:
                assert actions[old].dest == actions[flag].dest


def _argv(flag: str, option: options.Option, user: str, actions: dict) -> list[str]:
    if actions[flag].nargs == 0:  # store_true
        return [flag]
    value = {"--stream-weights": "on"}.get(flag, value_for(option, user))
    return [flag, str(value)]


@pytest.mark.parametrize("flag", sorted(flags.FLAGS["plan"]))
def test_plan_flags_check_with_the_definition(flag, capsys):
    option = flags.field_of("plan", flag)
    argv = ["--model-size", "13b", *_argv(flag, option, "plan-cli", _flags_of("plan"))]
    with marked_check(option) as mark:
        assert plan_main(argv) == 2
    assert mark in capsys.readouterr().err


@pytest.mark.parametrize("flag", sorted(flags.FLAGS["tune"]))
def test_tune_flags_check_with_the_definition(flag):
    option = flags.field_of("tune", flag)
    with marked_check(option) as mark, pytest.raises(Marked, match=mark):
        tune_args(_argv(flag, option, "tune", _flags_of("tune")))


@pytest.mark.parametrize("flag", sorted(flags.FLAGS["train_large"]))
def test_train_large_flags_check_with_the_definition(flag, capsys):
    option = flags.field_of("train_large", flag)
    preset = str(sorted((ROOT / "examples" / "configs" / "large").glob("*.yaml"))[0])
    value = value_for(option, "loop")
    with marked_check(option) as mark:
        assert _train_large().main(["--config", preset, "--dry-run", flag, str(value)]) == 2
    assert mark in capsys.readouterr().err


def test_a_deprecated_flag_still_works_and_logs_a_warning(caplog, capsys):
    flags._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        assert plan_main(["--model-size", "13b", "--gpu", "80GB", "--json"]) == 0
        new = capsys.readouterr().out
        assert plan_main(["--model-size", "13b", "--gpu-bytes", "80GB", "--json"]) == 0
        assert capsys.readouterr().out == new
    warned = [r.getMessage() for r in caplog.records if r.name == "tiermem"]
    assert warned == ["plan: --gpu is deprecated; use --gpu-bytes (budgets.gpu_bytes)"]
    old = tune_args(["--gpu-budget", "1GiB", "--cpu-budget", "2GiB", "--num-layers", "0,1"])
    assert (old.gpu_bytes, old.host_bytes, old.num_layers) == ("1GiB", "2GiB", [0, 1])


# ------------------------------------------------------------------ tiermem bench / demo flags


def test_every_bench_and_demo_has_its_tables():
    assert set(APP_COMMANDS) <= set(flags.FLAGS) and set(APP_COMMANDS) <= set(flags.UNMAPPED)
    assert set(flags.FLAGS) == set(flags.UNMAPPED) | {"plan", "tune", "train_large"}
    assert set(flags.USER) == set(flags.FLAGS)


def test_one_spelling_per_field_and_one_field_per_spelling():
    spellings: dict[str, set] = {}
    fields: dict[str, set] = {}
    for command, table in flags.FLAGS.items():
        for flag, dotted in table.items():
            assert dotted in options.OPTIONS, (command, flag, dotted)
            spellings.setdefault(dotted, set()).add(flag)
            fields.setdefault(flag, set()).add(dotted)
    assert {d: s for d, s in spellings.items() if len(s) > 1} == {}
    shared = {f: d for f, d in fields.items() if len(d) > 1}
    assert set(shared) == set(flags.SHARED), shared  # each reason names its fields
    for flag, dotted in shared.items():
        assert all(d in flags.SHARED[flag] for d in dotted), (flag, dotted)


@pytest.mark.parametrize("command", [c for c in APP_COMMANDS if flags.ALIASES.get(c)])
def test_a_deprecated_bench_flag_sets_the_same_value_and_warns(command, caplog):
    parser = _parser_of(command)
    required = ["--dir", "/tmp"] if command == "bench io" else []
    actions = _flags_of(command)
    flags._WARNED.clear()
    for old, new in flags.ALIASES[command].items():
        value = (actions[new].choices or ["3"])[-1]
        with caplog.at_level(logging.WARNING, logger="tiermem"):
            caplog.clear()
            got = vars(parser.parse_args(required + [old, value]))
            assert [r.getMessage() for r in caplog.records] == [
                f"{command}: {old} is deprecated; use {new} ({flags.FLAGS[command][new]})"]
        assert got == vars(parser.parse_args(required + [new, value]))
        assert str(got[actions[new].dest]) == value


def test_an_unmapped_bench_or_demo_flag_spelled_as_a_field_says_why():
    """A flag left local (Note [which flags map]) that is spelled as a field's name, or as the
    flag of a field in another command, names that field in its reason: a flag that does set
    the field cannot slip into UNMAPPED unread."""
    elsewhere: dict[str, set] = {}
    for table in flags.FLAGS.values():
        for flag, dotted in table.items():
            elsewhere.setdefault(flag, set()).add(dotted)
    for command in APP_COMMANDS:
        for flag, why in flags.UNMAPPED[command].items():
            word = flag[2:].replace("-", "_")
            near = {d for d, o in options.OPTIONS.items() if o.name == word}
            for dotted in near | elsewhere.get(flag, set()):
                assert dotted in why, (command, flag, dotted, why)
