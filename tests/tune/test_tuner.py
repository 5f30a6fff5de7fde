"""Cost model, tune() on a fake step and on the GPT demo, and the `tiermem tune` command."""

import io
import json
import time

import pytest
import torch

from tiermem import StoreConfig, TierStore
from tiermem.apps.cli import main as cli_main
from tiermem.apps.plan import MachineRates
from tiermem.apps.tune import (
    CostModel,
    Result,
    Trial,
    act_gpu_bytes,
    expand_grid,
    link_bytes,
    main,
    setting_labels,
    tune,
)


def rates(h2d, d2h, nvme_read, nvme_write, cpu_adam):
    """MachineRates with the cost model's rates: bytes/s, and params/s for the CPU Adam."""
    return MachineRates(pcie_h2d_bytes_per_s=h2d, pcie_d2h_bytes_per_s=d2h,
                        nvme_read_bytes_per_s=nvme_read, nvme_write_bytes_per_s=nvme_write,
                        cpu_adam_params_per_s=cpu_adam)


def test_link_bytes_maps_store_directions_to_links():
    assert link_bytes({"cpu->gpu": 10, "nvme->gpu": 5, "gpu->cpu": 3, "cpu->nvme": 2,
                       "nvme->cpu": 1, "put->gpu": 4}) == \
        {"h2d": 19, "d2h": 3, "nvme_read": 6, "nvme_write": 2}


def test_cost_model_predicts_serial_and_overlapped():
    m = CostModel(rates(h2d=50e9, d2h=25e9, nvme_read=2e9, nvme_write=1e9, cpu_adam=4e9))
    links = {"h2d": 10**9, "d2h": 10**9, "nvme_read": 2 * 10**9, "nvme_write": 10**9}
    assert m.link_seconds(links) == pytest.approx(
        {"h2d": 0.02, "d2h": 0.04, "nvme_read": 1.0, "nvme_write": 1.0})
    assert m.adam_seconds(2 * 10**9) == pytest.approx(0.5)
    assert m.predict_s(links, 2 * 10**9, compute_s=0.3) == pytest.approx(0.3 + 2.06 + 0.5)
    assert m.predict_s(links, 2 * 10**9, compute_s=0.3, overlap=True) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="pcie_h2d_bytes_per_s"):
        CostModel(rates(0, 1e9, 1e9, 1e9, 1e9))
    with pytest.raises(TypeError, match="MachineRates"):
        CostModel(50e9)
    with pytest.raises(ValueError, match="unknown link"):
        m.predict_s({"pcie": 1})
    with pytest.raises(ValueError, match="compute_s"):
        m.predict_s({}, compute_s=-1)


def test_cost_model_measure_gives_positive_rates(tmp_path):
    m = CostModel.measure("cpu", nbytes=1 << 20, nvme_dir=str(tmp_path), adam_params=1 << 14)
    for name in ("pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s", "nvme_read_bytes_per_s",
                 "nvme_write_bytes_per_s", "cpu_adam_params_per_s"):
        assert getattr(m.rates, name) > 0


def test_cost_model_and_planner_share_one_rates_model(tmp_path):
    """Issue 28: the tuner predicts from the planner's MachineRates (bytes/s), not rates of its
    own: by default the same H200 figures, and a measured machine keeps the rates it did not
    measure from its base."""
    assert CostModel().rates == MachineRates()
    base = MachineRates(gpu_flops=1e12, pcie_both_bytes_per_s=7e9)
    measured = MachineRates.measure("cpu", nbytes=1 << 20, nvme_dir=str(tmp_path),
                                    adam_params=1 << 14, probes=1, base=base)
    assert measured.ranges == {}  # one probe: no spread
    assert measured.rates.gpu_flops == 1e12 and measured.rates.pcie_both_bytes_per_s == 7e9
    model = CostModel(measured.rates)
    assert model.link_seconds({"d2h": 10**6})["d2h"] == \
        10**6 / measured.rates.pcie_d2h_bytes_per_s
    assert model.adam_seconds(10**6) == 10**6 / measured.rates.cpu_adam_params_per_s


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
    model = CostModel(rates(1e9, 1e9, 1e9, 1e9, 1e9))
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
    assert all(s.closed for s in stores)
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
    rc = main(["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "2",
               "--vocab", "64", "--num-layers", "0,1", "--offload-fraction", "0,1",
               "--state-tier", "cpu,nvme", "--prefetch-depth", "1", "--policy", "lru,trace",
               "--steps", "1", "--warmup", "2", "--nvme-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "yes *" in out and "cost model:" in out
    assert out.count(" trace ") >= 4 and out.count(" lru ") >= 4


def test_act_gpu_bytes_and_setting_labels():
    assert act_gpu_bytes(1.5, 1000) == 1500 and act_gpu_bytes("2", 1000) == 2000
    assert act_gpu_bytes("3GiB", 1000) == 3 << 30
    for bad in ("0", "-1", "lots", "inf"):
        with pytest.raises(ValueError, match="act_gpu_budget"):
            act_gpu_bytes(bad, 1000)
    assert setting_labels([{"policy": "lru", "n": 1}, {"policy": "trace", "n": 1, "la": 16}]) \
        == ["policy=lru", "policy=trace la=16"]
    assert setting_labels([{"n": 1}]) == ["setting 1"]


def test_tune_reports_counters_and_records_telemetry(tmp_path):
    def factory(setting):
        store = TierStore(StoreConfig(gpu_bytes=4096, cpu_bytes=1 << 16, pool_slab_bytes=1 << 16,
                                      device="cpu"))
        store.put("w", torch.zeros(1024), tier="cpu")
        calls = [0]

        def step():
            calls[0] += 1
            store.get("w")
            store.evict("w", "cpu")
            store.mark_step()

        return Trial(step=step, stores=[store], close=store.close,
                     counters=lambda: {"calls": calls[0], "moved_bytes": 4096 * calls[0]})

    results = tune(factory, {"x": [1, 2]}, steps=2, warmup=1, out=None,
                   telemetry_dir=str(tmp_path / "tel"))
    for r in results:
        assert r.counters == {"calls": 1.0, "moved_bytes": 4096.0}
        assert len(r.telemetry) == 1 and r.telemetry[0].summary()["steps"] == 1  # last step only
        assert r.link_bytes() == {"h2d": 4096, "d2h": 4096, "nvme_read": 0, "nvme_write": 0}
    assert sorted(p.name for p in (tmp_path / "tel").iterdir()) == \
        ["timeline.png", "trace.json", "tune.json"]
    doc = json.loads((tmp_path / "tel" / "tune.json").read_text())
    assert [r["label"] for r in doc["results"]] == ["x=1", "x=2"]
    assert "H2D MiB" in doc["table"] and "x=1: calls 1" in doc["table"]


def test_tiermem_tune_trace_beats_lru_under_pressure_with_telemetry(capsys, tmp_path):
    """The GPT with activation offload (5 of 6 blocks, prefetch depth 2) and HybridAdam (half
    offloaded), the activation store's gpu tier limited to 2 blocks: LRU evicts activations it
    needs next and reloads them; the trace policy moves far fewer bytes, follows its
    recording, and the run writes a Chrome trace, a timeline PNG and the results."""
    tel = tmp_path / "tel"
    rc = main(["--layers", "6", "--d-model", "64", "--heads", "1", "--seq", "64", "--batch", "2",
               "--num-layers", "5", "--prefetch-depth", "2", "--offload-fraction", "0.5",
               "--state-tier", "cpu", "--policy", "lru,trace", "--act-gpu-budget", "2",
               "--steps", "1", "--warmup", "1", "--no-model", "--gpu-budget", "1GiB",
               "--nvme-dir", str(tmp_path), "--telemetry-dir", str(tel)])
    out = capsys.readouterr().out
    assert rc == 0 and "H2D MiB" in out and "stall ms" in out and "telemetry: wrote" in out
    lru, trace = json.loads((tel / "tune.json").read_text())["results"]
    assert lru["setting"]["policy"] == "lru" and trace["setting"]["policy"] == "trace"
    assert lru["counters"]["offloaded_bytes"] == trace["counters"]["offloaded_bytes"] > 0
    assert trace["counters"]["followed_steps"] == 1.0
    moved = {r["setting"]["policy"]: r["link_bytes"]["h2d"] + r["link_bytes"]["d2h"]
             for r in (lru, trace)}
    assert moved["trace"] <= 0.9 * moved["lru"], moved
    assert trace["counters"]["evicted_bytes"] < lru["counters"]["evicted_bytes"]
    assert lru["counters"]["refetched_bytes"] > 0 and lru["counters"]["direct_reloads"] == 0
    events = json.loads((tel / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"policy=lru: tiermem transfers", "policy=lru: tiermem memory",
                     "policy=trace prefetch_lookahead=16: tiermem transfers",
                     "policy=trace prefetch_lookahead=16: tiermem memory"}
    assert any(e["ph"] == "X" and e["name"] == "gpu->cpu" for e in events)  # evictions shown
    assert (tel / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_model_measure_keeps_the_spread_of_its_probes(tmp_path):
    m = CostModel.measure("cpu", nbytes=1 << 20, nvme_dir=str(tmp_path), adam_params=1 << 14,
                          probes=3)
    assert set(m.ranges) == {"pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s",
                             "nvme_read_bytes_per_s", "nvme_write_bytes_per_s",
                             "cpu_adam_params_per_s"}
    for name, (low, high) in m.ranges.items():
        assert 0 < low <= getattr(m.rates, name) <= high
    assert "(" in m.describe() and "CPU Adam" in m.describe()
    with pytest.raises(ValueError, match="probes=0"):
        CostModel.measure("cpu", nbytes=1 << 20, probes=0)


def test_cost_model_prediction_range_brackets_the_prediction():
    m = CostModel(rates(50e9, 25e9, 2e9, 1e9, 4e9),
                  ranges={"pcie_h2d_bytes_per_s": (40e9, 60e9),
                          "nvme_read_bytes_per_s": (1e9, 3e9)})
    links = {"h2d": 10**9, "nvme_read": 2 * 10**9}
    fast, slow = m.predict_range_s(links, 0, compute_s=0.1)
    assert fast < m.predict_s(links, 0, compute_s=0.1) < slow
    assert slow == pytest.approx(0.1 + 1 / 40 + 2 / 1) and fast == pytest.approx(0.1 + 1 / 60 + 2 / 3)
    assert CostModel(rates(1e9, 1e9, 1e9, 1e9, 1e9)).predict_range_s({"h2d": 10**9}) \
        == (1.0, 1.0)  # no spread
    with pytest.raises(ValueError, match=r"ranges\['pcie_h2d_bytes_per_s'\]"):
        CostModel(rates(50e9, 25e9, 2e9, 1e9, 4e9),
                  ranges={"pcie_h2d_bytes_per_s": (51e9, 60e9)})


def test_tune_reports_a_prediction_off_by_more_than_2x(caplog):
    """Issue 17 item 7: a measured step far from the model's prediction is flagged in the table
    and logged as a warning, with the prediction's range."""
    out = io.StringIO()
    model = CostModel(rates(1e9, 1e9, 1e9, 1e9, 1e9))  # 1 GB/s, 1 G params/s: ~1 ms a step
    with caplog.at_level("WARNING", logger="tiermem"):
        results = tune(lambda s: (lambda: time.sleep(s["sleep_ms"] / 1e3)),
                       {"sleep_ms": [0, 30]}, steps=2, warmup=0, cost_model=model,
                       compute_s=0.001, out=out)
    slow = next(r for r in results if r.setting["sleep_ms"] == 30)
    assert slow.disagrees and slow.step_s > 2 * slow.predicted_s
    assert slow.predicted_range_s == (pytest.approx(0.001), pytest.approx(0.001))
    text = out.getvalue()
    assert "pred range" in text and " !" in text
    off_line = next(line for line in text.splitlines()
                    if line.startswith("measured vs predicted off by more than 2x: "))
    assert "sleep_ms=30 (" in off_line
    assert any("sleep_ms=30: measured" in r.getMessage() and r.levelname == "WARNING"
               for r in caplog.records)
