"""``tiermem bench activations`` runs end to end with tiny sizes on CPU and rejects bad input."""

import pytest
import torch

from tiermem.bench.activations import main


pytestmark = pytest.mark.usefixtures("one_thread")


def test_bench_runs_tiny_on_cpu(capsys, tmp_path):
    rc = main(["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "2",
               "--vocab", "64", "--steps", "1", "--warmup", "0", "--nvme-dir", str(tmp_path),
               "--nvme-bytes", "16MiB", "--cpu-bytes", "16MiB"])
    out = capsys.readouterr().out
    assert rc == 0
    for setup in ("no offload", "checkpoint every block", "save_on_cpu", "tiermem cpu N=1",
                  "double-buffered", "checkpoint + tiermem cpu", "tiermem nvme N=1",
                  "checkpoint + tiermem nvme"):
        assert setup in out, setup
    assert "ms/step" in out and "1.00x" in out


def test_bench_rejects_bad_sizes(capsys):
    assert main(["--layers", "0"]) == 2
    assert "--layers=0 must be >= 1" in capsys.readouterr().err
    assert main(["--layers", "4", "--num-layers", "9", "--d-model", "8", "--heads", "2",
                 "--seq", "4", "--vocab", "8", "--batch", "1", "--steps", "1"]) == 2
    assert "outside [0, 4)" in capsys.readouterr().err


def test_every_row_says_whether_it_trained_as_the_baseline(capsys):
    rc = main(["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "2",
               "--vocab", "64", "--steps", "2", "--warmup", "1", "--repeats", "2",
               "--only", "N=1", "--cpu-bytes", "16MiB"])
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in out.splitlines() if "tiermem cpu N=1" in line]
    assert rows and all(("exact" in r or "equal" in r) for r in rows), out
    assert "no offload (again" in out and "baseline" in out


def test_a_setup_that_trains_wrongly_is_reported_and_fails(capsys, monkeypatch):
    from tiermem.bench import activations

    def wrong(model):  # reloads every saved tensor slightly changed: wrong gradients
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t * 1.01 if t.is_floating_point() else t)

    real = activations._setups
    monkeypatch.setattr(activations, "_setups",
                        lambda *a: real(*a)[:2] + [("broken offload", False, wrong)])
    rc = main(["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "2",
               "--vocab", "64", "--steps", "2", "--warmup", "0", "--cpu-bytes", "16MiB"])
    captured = capsys.readouterr()
    line = next(r for r in captured.out.splitlines() if r.startswith("broken offload"))
    assert rc == 1 and "WRONG" in line
    assert "did not train as without offload: broken offload" in captured.err


def test_help_shows_cpu_sized_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    if not torch.cuda.is_available():
        assert "(default: 4)" in out and "(default: 128)" in out
