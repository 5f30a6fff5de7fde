"""What a new user meets first: clear one-line errors, created spill directories, the bench
help, the I/O backend choice and fallbacks on the ``tiermem`` logger (issue 17)."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import re
import pathlib
import stat
import sys

import pytest
import torch

from tiermem import _native
from tiermem._files import config_error, make_private_dir
from tiermem.apps.cli import BENCHES
from tiermem.apps.cli import main as cli_main
from tiermem.store import io as store_io

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ config files (item 4)

def test_config_error_is_one_line_for_a_directory_and_broken_yaml(tmp_path):
    import yaml

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layers: 2\n  d_model: [32\n")
    with pytest.raises(yaml.YAMLError) as exc:
        yaml.safe_load(bad.read_text())
    msg = config_error("--config", bad, exc.value)
    assert "\n" not in msg and "is not valid YAML" in msg and "line 4" in msg and "fix:" in msg
    with pytest.raises(IsADirectoryError) as exc:
        open(tmp_path)
    assert config_error("--config", tmp_path, exc.value) == (
        f"--config={str(tmp_path)!r} is a directory; fix: name a YAML file "
        f"(e.g. examples/configs/cpu.yaml)")


@pytest.mark.parametrize("example", ["train_gpt", "train_large"])
@pytest.mark.parametrize("kind", ["directory", "broken yaml", "not a mapping"])
def test_examples_refuse_a_bad_config_file_with_one_line_and_exit_2(tmp_path, capsys, example,
                                                                    kind):
    path = tmp_path / "cfg.yaml"
    if kind == "directory":
        path = tmp_path
    elif kind == "broken yaml":
        path.write_text("train: {steps: 2\n")
    else:
        path.write_text("- just\n- a list\n")
    assert _example(example).main(["--config", str(path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"{example}: error: ") and str(path) in line
    assert {"directory": "is a directory", "broken yaml": "is not valid YAML",
            "not a mapping": "mapping of sections"}[kind] in line


@pytest.mark.parametrize("example", ["train_gpt", "train_large"])
def test_a_non_utf8_config_names_the_file(tmp_path, capsys, example):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"train:\n  steps: 2\n# caf\xe9\n")
    assert _example(example).main(["--config", str(path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(path) in line and "UTF-8" in line and "fix:" in line, line


@pytest.mark.parametrize("example", ["train_gpt", "train_large"])
def test_a_broken_override_is_named_not_the_config_file(capsys, example):
    config = ROOT / "examples" / "configs" / ("cpu.yaml" if example == "train_gpt" else
                                              "large/h200_13b_nvme.yaml")
    argv = ["--config", str(config), "optimizer.betas=[0.9,"]
    assert _example(example).main(argv) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"{example}: error: override 'optimizer.betas=[0.9,': the value is "
                           f"not valid YAML") and "cpu.yaml" not in line, line


def test_train_large_names_a_missing_section(tmp_path, capsys):
    path = tmp_path / "partial.yaml"
    path.write_text("model: {n_layers: 2}\n")
    assert _example("train_large").main(["--config", str(path)]) == 2
    assert "lacks 'train'" in _one_line(capsys.readouterr().err)


# ------------------------------------------------------------------ CPU refusal (item 3)

@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_train_large_refuses_a_cuda_preset_on_the_cpu_before_planning(capsys):
    cfg = ROOT / "examples" / "configs" / "large" / "h200_20b_bf16.yaml"
    assert _example("train_large").main(["--config", str(cfg)]) == 2
    out, err = capsys.readouterr()
    line = _one_line(err)
    assert "CUDA is not available" in line and "--tiny" in line and "--dry-run" in line
    assert out == ""  # refused before the plan is printed
    assert _example("train_large").main(["--config", str(cfg), "--dry-run"]) == 0


# ------------------------------------------------------------------ spill directories (item 2)

def test_make_private_dir_creates_0700_and_refuses_a_file(tmp_path, caplog):
    target = tmp_path / "a" / "spill"
    with caplog.at_level(logging.INFO, logger="tiermem"):
        assert make_private_dir(target, "store.nvme_dir") is True
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700
    assert "created store.nvme_dir directory" in caplog.text
    assert make_private_dir(target, "store.nvme_dir") is False  # exists: left alone
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"--dir=.*exists and is not a directory; fix:"):
        make_private_dir(tmp_path / "file", "--dir")


def test_train_gpt_creates_a_missing_spill_directory(tmp_path, capsys):
    spill = tmp_path / "spill"
    argv = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16",
            "model.vocab=64", "train.steps=2", "train.micro_batch=2", "train.progress=false",
            "train.log_every=0", "optimizer.offload_fraction=0.5", "optimizer.state_tier=nvme",
            "store.nvme_bytes=64MiB", f"store.nvme_dir={spill}", "store.io_chunk_bytes=64KiB"]
    assert _example("train_gpt").main(argv) == 0
    assert stat.S_IMODE(os.stat(spill).st_mode) == 0o700
    assert f"created store.nvme_dir directory {spill} (mode 0700)" in capsys.readouterr().out


def test_bench_io_creates_its_dir_and_reports_median_and_spread(tmp_path, capsys):
    target = tmp_path / "new" / "dir"
    rc = cli_main(["bench", "io", "--dir", str(target), "--nbytes", "256KiB",
                   "--extent-bytes", "128KiB", "--chunk-bytes", "64KiB", "--block-bytes",
                   "128KiB", "--threads", "1", "--aiofiles-threads", "1", "--repeat", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o700 and os.listdir(target) == []
    assert "median of the repeats" in out and "write GB/s (spread)" in out
    spill_row = next(line for line in out.splitlines() if line.startswith("SpillSpace posix"))
    assert spill_row.count("(") >= 2 and "-" in spill_row  # "1.23 (1.01-1.40)" twice


# ------------------------------------------------------------------ bench help (item 6)

def test_bench_help_lists_every_benchmark_and_exits_0(capsys):
    assert cli_main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tiermem bench {")
    for name in BENCHES:
        assert f"\n  {name}" in out
    assert cli_main(["bench"]) == 2  # no benchmark named: the same help, on stderr
    assert "usage: tiermem bench" in capsys.readouterr().err


# ------------------------------------------------------------------ bench adam's columns

def test_bench_adam_prints_median_and_spread_and_no_bound_column(capsys):
    assert cli_main(["bench", "adam", "--numel", "20000", "--repeats", "3", "--threads",
                     "1"]) == 0
    out = capsys.readouterr().out
    assert "% of bound" not in out and "bound G params/s" not in out
    assert "| kernel | G params/s (median) | spread |" in out and "not a bound" in out
    assert cli_main(["bench", "adam", "--numel", "20000", "--repeats", "3", "--threads", "1",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for r in rows:
        assert r["gparams_min"] <= r["gparams_per_s"] <= r["gparams_max"]
        assert r["logical_gb_per_s"] == pytest.approx(r["gparams_per_s"] * r["bytes_per_param"])
        assert "fraction_of_bound" not in r
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "adam", "--repeats", "2"])
    assert exc.value.code == 2


# ------------------------------------------------------------------ logging (item 8), kvikio

def test_io_backend_auto_is_posix_even_when_kvikio_is_usable(monkeypatch, caplog):
    monkeypatch.setattr(store_io, "kvikio_usable", lambda: (True, ""))
    assert store_io.resolve_backend_name("auto") == "posix"
    with caplog.at_level(logging.INFO, logger="tiermem"):
        backend = store_io.make_backend("auto", 1)
    backend.shutdown()
    assert backend.name == "posix"
    assert "NVMe I/O backend: posix (io_backend='auto'" in caplog.text


def test_no_document_or_docstring_claims_gpudirect_storage():
    """kvikio only ever receives host buffers: nothing may say it uses GDS."""
    paths = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "tiermem").rglob("*.py"))]
    for path in paths:
        text = path.read_text()
        for claim in ("GDS or", "GDS when", "GPUDirect Storage or", "GPUDirect Storage, or",
                      "compat mode", "tiermem[gds]", '".[gds]"'):
            assert claim not in text, (path, claim)


def test_checksum_fallback_to_zlib_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(_native, "_load", lambda: None)
    monkeypatch.setattr(_native, "_zlib_noted", False)
    with caplog.at_level(logging.WARNING, logger="tiermem"):
        _native.crc32c(b"abc")
        _native.crc32c(b"def")
    hits = [r for r in caplog.records if "CRC-32C to zlib's CRC-32" in r.getMessage()]
    assert len(hits) == 1 and hits[0].levelno == logging.WARNING


def test_cli_shows_tiermem_log_records_on_stderr_only(tmp_path, capsys):
    logging.getLogger("tiermem").info("probe line for the test")  # before: no handler yet
    assert cli_main(["bench", "--help"]) == 0
    capsys.readouterr()
    logging.getLogger("tiermem").info("probe line for the test")
    logging.getLogger("tiermem").warning("probe warning")
    out, err = capsys.readouterr()
    assert out == ""
    assert "tiermem: probe line for the test\n" in err
    assert "tiermem: warning: probe warning\n" in err


def test_bench_transfer_prints_median_and_spread(capsys):
    assert cli_main(["bench", "transfer", "--nbytes", "64KiB", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    assert "median of 3 timed copies" in out and "raw GB/s (spread)" in out
    rows = [line for line in out.splitlines() if line.startswith(("H2D", "D2H", "both"))]
    assert len(rows) == 3 and all(re.search(r"\d\.\d\d \(\d+\.\d\d-\d+\.\d\d\)", r) for r in rows)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_show_on_a_terminal_only(monkeypatch):
    from tiermem._log import progress
    from tiermem.models.gpt import GPT, GPTConfig
    from tiermem.models import materialize_

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with progress(total=3, desc="quiet") as bar:
        bar.update(3)
    assert sys.stderr.getvalue() == ""  # captured output and logs get no bar
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab=64))
    materialize_(model, "cpu")
    shown = term.getvalue()
    n = sum(p.numel() for p in model.parameters())
    assert "materialize_" in shown and f"/{n / 1e3:.1f}k [" in shown  # the bar's total


def test_bench_activations_prints_as_it_goes(monkeypatch, one_thread):
    """tiermem bench activations was silent up to 97 s between rows (issue 27): now a line per
    run of a setup, and within a run a line at the first step after HEARTBEAT_S of silence
    (0 here: a line per step, so the count is the decision under test)."""
    from tiermem.apps.bench import activations as bench

    monkeypatch.setattr(bench, "HEARTBEAT_S", 0.0)
    args = bench._parse_args(["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16",
                              "--batch", "2", "--vocab", "64", "--steps", "1", "--warmup", "0",
                              "--repeats", "2", "--only", "all but"])
    lines: list[str] = []
    rows = bench.run(args, log=lines.append)
    assert len(rows) == 3  # no offload, its noise, tiermem cpu N=1
    for row in rows:
        name = row.setup
        steps = [s for s in lines if s.startswith(f"  {name}: run ") and "step 1/1 ..." in s]
        runs = [s for s in lines if re.fullmatch(rf"  {re.escape(name)}: run [12]/2: "
                                                 rf"[\d.]+ ms/step", s)]
        assert len(steps) == 2 and len(runs) == 2, lines
        assert lines.index(runs[0]) < lines.index(steps[1])  # run 1's line before run 2 starts
