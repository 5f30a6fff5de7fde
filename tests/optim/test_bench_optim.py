"""``tiermem bench optim`` (one process): the setup grammar and a tiny run on the CPU."""

import pytest
import torch

from tiermem.bench.optim import main, parse_setup


def test_setup_grammar():
    assert parse_setup("0.5") == {"fraction": 0.5, "tier": "cpu", "fwd": False, "bf16": False,
                                  "chunk": None, "gpu": 0.0}
    assert parse_setup("1.0:nvme+fwd+bf16+chunk=16M+gpu=0.4") == {
        "fraction": 1.0, "tier": "nvme", "fwd": True, "bf16": True, "chunk": 16 << 20,
        "gpu": 0.4}
    assert parse_setup("1+chunk=64K")["chunk"] == 64 << 10
    assert parse_setup("1+chunk=5000")["chunk"] == 5000


@pytest.mark.parametrize("bad", ["1.5", "x", "0.5:disk", "0.5+slow", "0.5+chunk=M", "1+gpu=2"])
def test_bad_setup_names_the_value_and_the_grammar(bad):
    with pytest.raises(ValueError, match=r"--setups: .*F\[:tier\]\[\+fwd\]"):
        parse_setup(bad)


def test_cpu_run_prints_each_setup_with_worker_time(capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU-sized defaults apply without CUDA")
    assert main(["--setups", "gpu,1.0+chunk=4K,0.5+bf16+gpu=0.5", "--steps", "1",
                 "--accum", "1"]) == 0
    out = capsys.readouterr().out
    table = out[out.rindex("setup"):].splitlines()
    assert "worker ms" in table[0]
    labels = [line[:37].strip() for line in table[1:]]
    assert labels == ["GPU-only fused AdamW", "HybridAdam f=1 cpu c4096",
                      "HybridAdam f=0.5 cpu bf16m gpu=0.5"]
    for line in table[2:]:
        assert float(line.split()[-2]) > 0  # the worker stepped chunks
