"""``tiermem bench activations`` runs end to end with tiny sizes on CPU and rejects bad input."""

import pytest
import torch

from tiermem.apps.bench.activations import main


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
    assert main(["--layers", "4", "--offload-layers", "9", "--d-model", "8", "--heads", "2",
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


def test_chunked_loss_runs_in_every_row_and_every_row_trains_as_the_baseline(capsys,
                                                                               monkeypatch):
    from tiermem.apps.bench import activations

    models, real = [], activations.GPT

    def gpt(*args, **kw):  # the bench's model, recorded
        models.append(real(*args, **kw))
        return models[-1]

    monkeypatch.setattr(activations, "GPT", gpt)
    rc = main(["--layers", "2", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch", "2",
               "--vocab", "64", "--steps", "2", "--warmup", "1", "--cpu-bytes", "16MiB",
               "--loss-chunk-tokens", "12"])  # 32 tokens a batch: chunks of 12, 12, 8
    out = capsys.readouterr().out
    assert rc == 0
    assert "loss_chunk_tokens=12" in out.splitlines()[0]
    assert [m.loss_chunk_tokens for m in models] == [12]  # one model serves every row
    table = out[out.index("setup"):].splitlines()[1:]
    assert len(table) >= 8, out
    for row in table:
        assert "baseline" in row or "exact" in row or "equal" in row, row
    assert sum("baseline" in row for row in table) == 1


def test_loss_chunk_tokens_off_by_default_and_checked(capsys):
    assert main(["--loss-chunk-tokens", "0"]) == 2
    assert "--loss-chunk-tokens=0 must be >= 1" in capsys.readouterr().err
    from tiermem.apps.bench.activations import _parse_args
    assert _parse_args([]).loss_chunk_tokens is None


def test_a_setup_that_trains_wrongly_is_reported_and_fails(capsys, monkeypatch):
    from tiermem.apps.bench import activations

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
