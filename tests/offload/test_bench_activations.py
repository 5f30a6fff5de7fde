"""``tiermem bench activations`` runs end to end with tiny sizes on CPU and rejects bad input."""

import pytest
import torch

from tiermem.bench.activations import main


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
