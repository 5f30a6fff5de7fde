"""A deprecated flag and its new spelling given together (Note [both spellings] in
tiermem/flags.py): refused with a message naming both, in either order; one spelling given
twice keeps argparse's rule (the last value)."""

from __future__ import annotations

import argparse

import pytest

from tiermem import flags
from tiermem.apps.plan.cli import main as plan_main

PAIRS = [(command, old, new) for command, table in sorted(flags.ALIASES.items())
         for old, new in sorted(table.items())]


def _parser(command: str, new: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=command, exit_on_error=False)
    flags.add(parser, command, new, default=None)
    return parser


@pytest.mark.parametrize("command,old,new", PAIRS)
def test_both_spellings_of_one_flag_are_refused_in_either_order(command, old, new):
    parser = _parser(command, new)
    for argv in ([old, "1", new, "2"], [new, "2", old, "1"]):
        with pytest.raises(argparse.ArgumentError) as info:
            parser.parse_args(argv)
        message = str(info.value)
        assert old in message and new in message, message
    # the same value in both spellings is refused too: one field, one flag on a command line
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args([old, "1", new, "1"])


@pytest.mark.parametrize("command,old,new", PAIRS)
def test_one_spelling_given_twice_takes_the_last_value(command, old, new):
    parser = _parser(command, new)
    dest = parser._option_string_actions[new].dest
    assert getattr(parser.parse_args([new, "1", new, "2"]), dest) == "2"
    assert getattr(parser.parse_args([old, "1", old, "2"]), dest) == "2"
    # each parse starts afresh: a spelling given in one parse is not held against the next
    assert getattr(parser.parse_args([old, "3"]), dest) == "3"
    assert getattr(parser.parse_args([new, "4"]), dest) == "4"


def test_plan_refuses_gpu_and_gpu_bytes_together(capsys):
    """On the old code the last one silently won: ``--gpu 40GB --gpu-bytes 80GB`` planned for
    80 GB, ``--gpu-bytes 80GB --gpu 40GB`` for 40 GB, with only a deprecation warning."""
    assert plan_main(["--model-size", "13b", "--gpu", "40GB", "--gpu-bytes", "80GB",
                      "--json"]) == 2
    err = capsys.readouterr().err
    assert "--gpu" in err and "--gpu-bytes" in err and "not both" in err, err


def test_a_caller_namespace_without_weak_references_still_refuses_both():
    import types
    parser = _parser("plan", "--gpu-bytes")
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--gpu", "1", "--gpu-bytes", "2"], namespace=types.SimpleNamespace())
    got = parser.parse_args(["--gpu", "1"], namespace=types.SimpleNamespace())
    assert got.gpu_bytes == "1"
