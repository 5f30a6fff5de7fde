"""``tiermem bench optim --world 2``: the FSDP2 / data-parallel optimizer benchmark end to end
(gloo on the CPU; NCCL on 2 GPUs with ``-m cuda``), its rank-failure path and its validation."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tiermem.apps.bench import optim_dist
from tiermem.models.gpt import GPTConfig
from tiermem.apps.bench.optim import main

TINY = ["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--vocab", "64",
        "--batch", "2"]
LABELS = ["fsdp2 fused AdamW (GPU)", "fsdp2 + HybridAdam f=0.5 cpu", "fsdp2 + HybridAdam f=1 cpu",
          "dp HybridAdam f=0.5 cpu", "dp HybridAdam f=1 cpu"]


def run_main(monkeypatch, argv: list[str]) -> tuple[int, list[dict]]:
    """``main(argv)``, and the rows its distributed run returned (a spy on ``optim_dist.run``)."""
    got = []
    real = optim_dist.run

    def spy(*args, **kw):
        got.extend(real(*args, **kw))
        return got

    monkeypatch.setattr(optim_dist, "run", spy)
    return main(argv), got


def table_rows(out: str) -> dict[str, list[str]]:
    """The final table's rows by setup label: the other columns as strings."""
    lines = out.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("setup"))
    rows = {}
    for line in lines[start + 1:]:
        if line[:30].strip() in LABELS:
            rows[line[:30].strip()] = line[30:].split()
    return rows


def check_rows(rows: list[dict], world: int = 2) -> None:
    """Every setup ran; the state is sharded 1/world; losses are finite and agree."""
    assert [r["setup"] for r in rows] == LABELS
    first = rows[0]["losses"][0]  # step 1: the same weights and data in every setup
    for r in rows:
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and math.isfinite(r["x"])
        assert r["share"] == pytest.approx(1 / world, abs=0.02), r["setup"]
        assert all(math.isfinite(v) for v in r["losses"])
        assert r["losses"][0] == pytest.approx(first, rel=1e-2)
        held = r["gpu_bytes"] + r["off_bytes"]
        assert held <= r["unsharded_bytes"] * (1 / world + 0.02), r["setup"]
        if r["setup"].endswith("f=1 cpu"):  # all of the rank's state is offloaded: 1/world
            assert r["gpu_bytes"] == 0
            assert r["off_bytes"] == pytest.approx(r["unsharded_bytes"] / world, rel=0.02)
            assert r["host_bytes"] >= r["off_bytes"]  # plus its pinned staging buffers
        if r["setup"].endswith("f=0.5 cpu"):
            assert r["off_bytes"] == pytest.approx(r["unsharded_bytes"] / world / 2, rel=0.1)
    base = rows[0]
    assert base["off_bytes"] == 0 and base["x"] == 1.0
    assert base["gpu_bytes"] == pytest.approx(base["unsharded_bytes"] / world, rel=0.02)


def test_world_2_on_cpu_prints_every_setup_with_half_the_state_per_rank(monkeypatch, capfd,
                                                                         tmp_path):
    rc, rows = run_main(monkeypatch, TINY + ["--world", "2", "--steps", "2",
                                             "--grad-accumulation-steps", "1",
                                             "--nvme-dir", str(tmp_path)])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "gloo on the CPU, 2 ranks" in out
    check_rows(rows)
    printed = table_rows(out)
    assert list(printed) == LABELS
    for cols in printed.values():  # tokens, ms, x, peak, state GPU, off, unsharded, share, loss
        assert cols[0] == str(2 * 2 * 16) and cols[3] == "-"
        assert float(cols[7]) == pytest.approx(0.5, abs=0.02)
        assert float(cols[8]) == pytest.approx(float(printed[LABELS[0]][8]), abs=1e-2)
    assert os.listdir(tmp_path) == []  # the work directory is removed


def test_a_failing_rank_is_named_and_does_not_hang(tmp_path):
    # rank 1 cannot create its spill directory (a file is in the way); rank 0 is then blocked
    # in a collective until the launcher stops it
    os.makedirs(tmp_path / "spill")
    (tmp_path / "spill" / "rank1").write_text("not a directory")
    cfg = GPTConfig(n_layers=1, d_model=32, n_heads=4, seq_len=16, vocab=64)
    with pytest.raises(optim_dist.RankFailed) as info:
        optim_dist.run(cfg, 2, [1], [optim_dist.Setup("adamw"), optim_dist.Setup("dp", 1.0, "nvme")],
                       1, world=2, workdir=str(tmp_path), nvme_steps=1, timeout_s=120)
    message = str(info.value)
    assert "rank 1" in message and "dp HybridAdam f=1 nvme" in message
    assert [r["setup"] for r in info.value.rows] == ["fsdp2 fused AdamW (GPU)"]


def test_bad_flags_name_the_flag():
    with pytest.raises(ValueError, match="--world=0 must be >= 1"):
        main(TINY + ["--world", "0"])
    with pytest.raises(ValueError, match="'naive' runs only with --world 1"):
        main(TINY + ["--world", "2", "--setups", "gpu,naive"])
    with pytest.raises(ValueError, match="--grad-accumulation-steps='0' must be"):
        main(TINY + ["--world", "2", "--grad-accumulation-steps", "0"])
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA GPU"):
            main(TINY + ["--world", str(torch.cuda.device_count() + 1)])
    assert optim_dist.parse_setups("dp:0.25:nvme,0.5") == [
        optim_dist.Setup("adamw"), optim_dist.Setup("fsdp", 0.5), optim_dist.Setup("dp", 0.25, "nvme"),
        optim_dist.Setup("dp", 0.5)]


@pytest.mark.cuda
def test_world_2_on_two_gpus_with_nccl(monkeypatch, capfd):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (device kind nvidia-h200-x2)")
    rc, rows = run_main(monkeypatch, ["--layers", "2", "--d-model", "256", "--heads", "4",
                                      "--seq", "256", "--vocab", "1024", "--batch", "2",
                                      "--world", "2", "--steps", "2",
                                      "--grad-accumulation-steps", "1,2",
                                      "--timeout", "300"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert "nccl on 2 x" in out
    for accum in (1, 2):
        mine = [r for r in rows if r["accum"] == accum]
        check_rows(mine)
        assert all(r["peak_gib"] is not None and r["peak_gib"] > 0 for r in mine)
