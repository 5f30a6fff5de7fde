"""Cost model, tune() on a fake step and on the GPT demo, and the `tiermem tune` command."""

import io
import time

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.cli import main as cli_main
from tiermem.schedule.tuner import CostModel, Result, Trial, expand_grid, link_bytes, main, tune


def test_link_bytes_maps_store_directions_to_links():
    assert link_bytes({"cpu->gpu": 10, "nvme->gpu": 5, "gpu->cpu": 3, "cpu->nvme": 2,
                       "nvme->cpu": 1, "put->gpu": 4}) == \
        {"h2d": 19, "d2h": 3, "nvme_read": 6, "nvme_write": 2}


def test_cost_model_predicts_serial_and_overlapped():
    m = CostModel(h2d_gbps=50, d2h_gbps=25, nvme_read_gbps=2, nvme_write_gbps=1,
                  cpu_adam_gparams=4)
    links = {"h2d": 10**9, "d2h": 10**9, "nvme_read": 2 * 10**9, "nvme_write": 10**9}
    assert m.link_seconds(links) == pytest.approx(
        {"h2d": 0.02, "d2h": 0.04, "nvme_read": 1.0, "nvme_write": 1.0})
    assert m.adam_seconds(2 * 10**9) == pytest.approx(0.5)
    assert m.predict_s(links, 2 * 10**9, compute_s=0.3) == pytest.approx(0.3 + 2.06 + 0.5)
    assert m.predict_s(links, 2 * 10**9, compute_s=0.3, overlap=True) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="h2d_gbps"):
        CostModel(0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown link"):
        m.predict_s({"pcie": 1})
    with pytest.raises(ValueError, match="compute_s"):
        m.predict_s({}, compute_s=-1)


def test_cost_model_measure_gives_positive_rates(tmp_path):
    m = CostModel.measure("cpu", nbytes=1 << 20, nvme_dir=str(tmp_path), adam_params=1 << 14)
    for name in ("h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps", "cpu_adam_gparams"):
        assert getattr(m, name) > 0


def test_expand_grid():
    assert expand_grid({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
    assert expand_grid([{"a": 1}]) == [{"a": 1}]
    with pytest.raises(ValueError, match="empty"):
        expand_grid({"a": []})
    with pytest.raises(ValueError, match="empty"):
        expand_grid([])


def test_tune_measures_marks_fastest_that_fits_and_reports_failures():
    stores = []

    def factory(setting):
        if setting["sleep_ms"] == 99:
            raise ValueError("bad combination")
        store = TierStore(StoreConfig(gpu_bytes=setting["gpu"], cpu_bytes=1 << 16,
                                      pool_slab_bytes=1 << 16, device="cpu"))
        store.put("w", torch.zeros(1024), tier="cpu")
        stores.append(store)

        def step():
            store.get("w")  # cpu -> gpu, then back down
            store.evict("w", "cpu")
            time.sleep(setting["sleep_ms"] / 1e3)

        return Trial(step=step, stores=[store], adam_params=1000, close=store.close)

    out = io.StringIO()
    model = CostModel(1, 1, 1, 1, 1)
    results = tune(factory, {"sleep_ms": [1, 10, 99], "gpu": [4096, 1 << 16]}, steps=2,
                   budgets={"gpu": 8192}, cost_model=model, out=out)
    assert len(results) == 6 and all(isinstance(r, Result) for r in results)
    failed = [r for r in results if r.error]
    assert len(failed) == 2 and all("bad combination" in r.error and not r.fits for r in failed)
    ok = [r for r in results if not r.error]
    for r in ok:
        assert r.moved_bytes == {"cpu->gpu": 4096, "gpu->cpu": 4096}
        assert r.peak_bytes["gpu"] == 4096 and r.fits  # peak of the store's gpu tier
        assert r.step_s >= r.setting["sleep_ms"] / 1e3 and r.stall_s >= 0
        assert r.predicted_s is not None and r.predicted_s > 0
    best = [r for r in results if r.best]
    assert len(best) == 1 and best[0].setting["sleep_ms"] == 1
    text = out.getvalue()
    assert "ms/step" in text and "pred ms" in text and "yes *" in text and "no: ValueError" in text
    assert all(s._closed for s in stores)
    with pytest.raises(ValueError, match="steps"):
        tune(factory, {"sleep_ms": [1], "gpu": [1]}, steps=0)
    with pytest.raises(ValueError, match="unknown tier"):
        tune(factory, {"sleep_ms": [1], "gpu": [1]}, budgets={"hbm": 1})


def test_tune_accepts_a_plain_step_function():
    calls = []
    results = tune(lambda s: (lambda: calls.append(s["x"])), {"x": [1, 2]}, steps=2, warmup=1,
                   out=None)
    assert calls == [1, 1, 1, 2, 2, 2] and all(r.fits for r in results)
    assert results[0].best != results[1].best


def test_tiermem_tune_help_and_bad_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["tune", "--help"])
    assert exc.value.code == 0 and "--offload-fraction" in capsys.readouterr().out
    assert cli_main(["tune", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert cli_main(["tune", "--policy", "fifo"]) == 2


def test_tiermem_tune_runs_the_gpt_demo(capsys, tmp_path):
    t0 = time.perf_counter()
    rc = main(["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
               "--vocab", "64", "--num-layers", "0,1", "--offload-fraction", "0,1",
               "--state-tier", "cpu,nvme", "--prefetch-depth", "1", "--policy", "lru,trace",
               "--steps", "1", "--warmup", "2", "--nvme-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "yes *" in out and "cost model:" in out
    assert out.count(" trace ") >= 4 and out.count(" lru ") >= 4
    assert time.perf_counter() - t0 < 30
