"""Note [NVMe home] on CUDA: examples/train_lora.py's run() with the frozen base on NVMe only
(``--stream-tier nvme --staging-blocks 2``, and with ``--layerwise-base``: no RAM copy of the
base, 2 layers of pinned RAM staging), the process capped at 1 GiB after the stream, trains as
the same run without streaming over 8 steps; the tolerance is the unstreamed run's own noise
(run twice), 0 when its kernels are deterministic. The same comparison runs on the CPU (exact)
as a smoke of it."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("peft")

from test_lora import ex  # noqa: E402, F401  (the module-scoped examples/train_lora.py fixture)

STEPS = 8


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(preset="tiny", seq=64, batch=2, steps=STEPS, rank=8, checkpoint=True,
                offload="layers", offload_fraction=1.0, stream_weights=True, stream_tier="nvme",
                prefetch_blocks=1, stream_schedule="depth-first", nvme_dir=str(tmp_path),
                staging_blocks=2, gpu_bytes=None, layerwise_base=False)
    return argparse.Namespace(**{**base, **kw})


def _compare(ex, device: torch.device, tmp_path, offload: bool, layerwise: bool) -> None:
    cap = (1 << 30) if device.type == "cuda" else None
    streamed = ex.run(_args(tmp_path, gpu_bytes=cap, layerwise_base=layerwise), device,
                      offload=offload, log=lambda _: None, stream=True)
    plain = [ex.run(_args(tmp_path, layerwise_base=layerwise), device, offload=offload,
                    log=lambda _: None, stream=False) for _ in range(2)]

    def diff(a, b):
        return max([abs(x - y) for x, y in zip(a.losses, b.losses)]
                   + [(x - y).abs().max().item() for x, y in zip(a.adapters, b.adapters)])

    noise = diff(plain[0], plain[1])
    assert diff(streamed, plain[0]) <= 4 * noise, (diff(streamed, plain[0]), noise)
    st = streamed.stream_stats
    assert st["fills"] == STEPS * 3  # 3 layers, all kept into the backward
    assert 1 <= st["staging_peak_blocks"] <= 2 and st["nvme_writes"] == 0
    if cap is not None:
        assert streamed.peak_bytes < cap


CASES = [(False, False), (True, False), (True, True)]  # activation offload, layer-wise base


@pytest.mark.parametrize("offload,layerwise", CASES)
def test_cpu_smoke_of_the_cuda_comparison(ex, tmp_path, offload, layerwise):
    _compare(ex, torch.device("cpu"), tmp_path, offload, layerwise)


@pytest.mark.cuda
@pytest.mark.parametrize("offload,layerwise", CASES)
def test_cuda_lora_base_homed_on_nvme_matches_the_unstreamed_run(ex, tmp_path, offload,
                                                                 layerwise):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _compare(ex, torch.device("cuda"), tmp_path, offload, layerwise)
