"""examples/train_large.py's ``--steps`` is train.steps (tiermem/flags.py): checked by that
field's definition like every other flag of the command, and applied before the dotted
overrides like them (Note [which flags map])."""

from __future__ import annotations

from pathlib import Path

import pytest
from _examples import load_example

ROOT = Path(__file__).resolve().parents[1]
PRESET = str(ROOT / "examples" / "configs" / "large" / "h200_13b_nvme.yaml")


def _train_large():
    return load_example("train_large")


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_a_bad_steps_flag_is_refused_naming_the_field(steps, capsys):
    """On the old code ``--steps 0`` fell back to the preset's steps (``args.steps or
    t.steps``) and ``--steps -1`` trained nothing and said "done" (exit 0): the flag's value
    never reached TrainConfig's check."""
    assert _train_large().main(["--config", PRESET, "--dry-run", "--steps", steps]) == 2
    assert "train.steps" in capsys.readouterr().err


def test_the_steps_flag_sets_train_steps_and_a_dotted_override_comes_after(monkeypatch):
    module = _train_large()
    seen = []
    make_plan = module.make_plan

    def record(cfg):
        seen.append(cfg["train"].steps)
        return make_plan(cfg)

    monkeypatch.setattr(module, "make_plan", record)
    assert module.main(["--config", PRESET, "--dry-run", "--steps", "3"]) in (0, 1)
    assert module.main(["--config", PRESET, "--dry-run", "--steps", "3",
                        "train.steps=7"]) in (0, 1)
    assert seen == [3, 7]
