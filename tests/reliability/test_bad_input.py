"""Issue 16.8: odd budgets get the same clear message as other bad budgets; evict to a missing
nvme tier is a ValueError; a closed store reports nothing in use and refuses lookups.
Issue 27.7: a YAML alias bomb or a deeply nested value, in a config file or an override, is one
short error line with exit 2 (Note [bounded YAML], Note [bounded repr])."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from _faults import rand, small_store
from tiermem import StoreConfig, TierStore
from tiermem.config import OptimizerConfig, apply_overrides, load_config
from tiermem.names import short_repr
from tiermem.store.store import StoreClosedError


@pytest.mark.parametrize("field", ["gpu_bytes", "cpu_bytes", "nvme_bytes", "pool_slab_bytes"])
@pytest.mark.parametrize("value", ["1e400", float("inf"), float("-inf"), float("nan"), "inf",
                                   "nan"])
def test_non_finite_budgets_name_the_field(field, value):
    kw = {field: value}
    if field == "nvme_bytes":
        kw["nvme_dir"] = "/tmp"
    with pytest.raises(ValueError, match=rf"StoreConfig\.{field}={re.escape(repr(value))} is "
                                         rf"(not a finite byte size|not a byte size|negative)"):
        StoreConfig(**kw)


def test_evict_to_a_missing_nvme_tier_is_a_value_error(tmp_path):
    store = TierStore(StoreConfig(gpu_bytes=1 << 20, cpu_bytes=1 << 20, device="cpu"))
    store.put("k", rand(100), tier="cpu")
    with pytest.raises(ValueError, match=r"evict\('k', 'nvme'\): this store has no nvme tier "
                                         r"\(StoreConfig.nvme_bytes=0\)"):
        store.evict("k", "nvme")
    assert store.tier_of("k") == "cpu" and torch.equal(store.get("k", "cpu"), rand(100))
    store.close()


def test_a_closed_store_uses_nothing_and_refuses_lookups(tmp_path):
    store = small_store(tmp_path)
    store.put("k", rand(2000), tier="nvme")
    store.put("j", rand(100), tier="cpu")
    store.synchronize()
    assert store.used_bytes("nvme") > 0
    store.close()
    assert [store.used_bytes(t) for t in ("gpu", "cpu", "nvme")] == [0, 0, 0]
    for call in (lambda: store.tier_of("k"), lambda: store.nbytes_of("k"),
                 lambda: store.release("k"), lambda: store.get("k"),
                 lambda: store.put("x", rand(10))):
        with pytest.raises(StoreClosedError, match="this TierStore is closed"):
            call()
    store.synchronize()  # nothing in flight: a no-op, as close() is
    store.close()


# ------------------------------------------------------------------ issue 27.7: bounded YAML

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 120  # a python + torch start; the old code took > 25 s and > 2.5 GB per case


def _bomb() -> str:
    """A flow list of 7 anchors, each listing the previous one 9 times: 9^7 = 4.8M strings."""
    items = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdef", "bcdefg"):
        items.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "[" + ", ".join(items) + "]"


def _run_cli(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=CLI_TIMEOUT_S, cwd=ROOT)


def _one_short_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and len(lines[0]) < 600, err[:2000]
    return lines[0]


@pytest.mark.parametrize("where", ["field value", "whole section", "override"])
def test_an_alias_bomb_is_one_line_and_exit_2(tmp_path, where):
    bomb = _bomb()
    assert len(bomb) < 405
    if where == "override":
        proc = _run_cli(["-m", "tiermem.apps.cli", "demo", f"optimizer.lr={bomb}"])
        prefix, mention = "tiermem demo: error: override ", "once its aliases are expanded"
    else:
        path = tmp_path / "bomb.yaml"
        path.write_text(f"optimizer:\n  lr: {bomb}\n" if where == "field value"
                        else f"optimizer: {bomb}\n")
        proc = _run_cli(["examples/train_gpt.py", "--config", str(path), "--print-config"])
        prefix, mention = f"train_gpt: error: config file {str(path)!r}", "alias bomb"
    line = _one_short_line(proc.stderr)
    assert proc.returncode == 2 and line.startswith(prefix) and mention in line, proc.stderr


def test_a_100000_deep_list_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("optimizer:\n  lr: " + "[" * 100_000 + "]" * 100_000 + "\n")
    proc = _run_cli(["examples/train_gpt.py", "--config", str(path), "--print-config"])
    line = _one_short_line(proc.stderr)
    assert proc.returncode == 2 and "nested more than 32 levels deep at line 2" in line, line


def test_bounded_yaml_in_process(tmp_path):
    """The decisions themselves: depth and expanded size are refused, a cycle is refused, a
    plain config (with an ordinary alias) loads, and a huge value prints short."""
    with pytest.raises(ValueError, match=r"override 'optimizer.lr=\[\[\[.*nested more than 32"):
        apply_overrides({}, ["optimizer.lr=" + "[" * 60_000 + "]" * 60_000])
    with pytest.raises(ValueError, match="a node that contains it"):
        apply_overrides({}, ["optimizer.betas=&x [0.9, *x]"])
    ok = tmp_path / "ok.yaml"
    ok.write_text("optimizer: &o {lr: 0.01}\nstore: {nvme_dir: /tmp}\n")
    assert load_config(ok, ["optimizer.betas=[0.8, 0.9]"]) == {
        "optimizer": {"lr": 0.01, "betas": [0.8, 0.9]}, "store": {"nvme_dir": "/tmp"}}
    big = tmp_path / "big.yaml"
    big.write_text("optimizer: {lr: [" + ",".join(["1"] * 100_001) + "]}\n")
    with pytest.raises(ValueError, match=r"holds more than 100,000 values"):
        load_config(big)
    huge = [["x" * 1000] * 100] * 10  # a 1 MB repr (larger ones took the old code minutes)
    with pytest.raises(TypeError) as exc:
        OptimizerConfig(lr=huge)
    assert len(str(exc.value)) < 400 and "optimizer.lr must be a number, got list [['xx" in str(
        exc.value)
    assert short_repr(0.001) == "0.001" and short_repr("cuda:0") == "'cuda:0'"
