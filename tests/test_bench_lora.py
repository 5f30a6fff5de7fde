"""``tiermem bench lora`` runs end to end with the tiny preset on the CPU, prints every setup
at both sequence lengths with its parity verdict, and reports a setup that trains wrongly."""

import re

import pytest
import torch

from tiermem.apps.bench import lora
from tiermem.apps.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--seqs", "16,24", "--steps", "1", "--warmup", "0", "--repeats", "1"]


def test_bench_lora_runs_tiny_on_cpu(capsys):
    assert cli_main(["bench", "lora", *TINY]) == 0
    out = capsys.readouterr().out
    for seq in (16, 24):
        for setup, _, _ in lora.SETUPS:
            pattern = re.compile(rf"^\s*{seq}\s+{re.escape(setup)}\s{{2,}}\d")
            line = next((r for r in out.splitlines() if pattern.match(r)), None)
            assert line is not None, (seq, setup, out)
            assert setup == "no offload" or "exact" in line or "equal" in line, line
    assert "peak GiB" in out and "moved MiB" in out and "1.00x" in out


def test_bench_lora_reports_a_setup_that_trains_wrongly(capsys, monkeypatch):
    def wrong(blocks, **kw):  # every saved tensor comes back slightly changed
        return WrongHooks()

    class WrongHooks(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self):
            super().__init__(lambda t: t, lambda t: t * 1.01 if t.is_floating_point() else t)

        def stats(self):
            return {"put_bytes": 0}

        def close(self):
            pass

    monkeypatch.setattr(lora, "offload_activations", wrong)
    assert lora.main(["--seqs", "16", "--steps", "2", "--warmup", "0", "--repeats", "1"]) == 1
    captured = capsys.readouterr()
    line = next(r for r in captured.out.splitlines() if r.split()[1:2] == ["offload"])
    assert "WRONG" in line
    assert "did not train as without offload: offload (seq 16)" in captured.err


@pytest.mark.parametrize("argv,message", [
    (["--seqs", "16,x"], "--seqs='16,x' must be comma-separated integers"),
    (["--seqs", "1"], "needs lengths >= 2"),
    (["--layers", "1"], "--layers=1 must be >= 2"),
    (["--repeats", "0"], "--repeats=0 must be >= 1"),
])
def test_bench_lora_rejects_bad_input(capsys, argv, message):
    assert lora.main(argv) == 2
    assert message in capsys.readouterr().err
