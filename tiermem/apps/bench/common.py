"""What every ``tiermem bench`` shares: the device it runs on, timing that waits for the
device, the training batches (the byte columns are :func:`tiermem.names.gib` /
:func:`tiermem.names.mib`)."""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch

from tiermem.apps.bench.parity import report_wrong
from tiermem.names import resolve_device


def bench_device() -> torch.device:
    """The current CUDA device when CUDA is present, else the CPU."""
    return resolve_device("auto")


def learnable_batches(vocab: int, batch: int, seq: int, count: int,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` different ``(idx, targets)`` batches of ``(batch, seq)`` token ids, batch ``i``
    from seed ``i`` (the same for every setup of a bench); the target of a token is a fixed
    function of it, so the loss can fall.

    Raises:
        Nothing.
    """
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        idx = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((idx.to(device), ((idx * 7 + 3) % vocab).to(device)))
    return out


def parse_clips(text: str, example: str = "off,1e6,1e-3") -> list[tuple[str, float | None]]:
    """Parse a bench's ``--max-grad-norm`` grid (``tiermem bench optim``, ``tiermem bench
    stream``): comma-separated ``off`` or positive finite ``max_grad_norm`` values; returns
    ``(as written, value or None)`` pairs in order, duplicates dropped. ``example``: the grid
    the error message offers as the fix.

    Raises:
        ValueError: an entry that is neither, naming it and the fix.
    """
    out: list[tuple[str, float | None]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            value = None if item == "off" else float(item)
        except ValueError:
            value = float("nan")
        if value is not None and not 0.0 < value < float("inf"):
            raise ValueError(f"--max-grad-norm: {item!r} is not off or a positive finite "
                             f"max_grad_norm (e.g. --max-grad-norm {example})")
        if all(value != v for _, v in out):
            out.append((item, value))
    if not out:
        raise ValueError(f"--max-grad-norm: {text!r} names no threshold "
                         f"(e.g. --max-grad-norm {example})")
    return out


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # benchmark timing only: the timed work must have finished


def time_s(fn: Callable[[], object], repeats: int, device: torch.device | None = None,
           warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn()`` after ``warmup`` untimed ones, each
    ended by :func:`sync` of ``device`` (None: host work only)."""
    def once() -> None:
        fn()
        if device is not None:
            sync(device)

    for _ in range(warmup):
        once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return times


def bench_main(argv: list[str] | None, parse_args: Callable, header: Callable, run: Callable,
               format_table: Callable, wrong: Callable | None = None,
               errors: tuple[type[BaseException], ...] = (ValueError,),
               baseline: str = "without offload") -> int:
    """The ``main`` of a table benchmark: parse, print ``header(args)``, ``run(args, log)``
    (progress lines on stderr), print ``format_table(rows)``.

    Returns the exit code: 2 when parsing or the run raises one of ``errors`` (the message on
    stderr), 1 when ``wrong(rows)`` names setups whose losses were not the baseline's
    (:func:`tiermem.apps.bench.parity.report_wrong`, which names the baseline as ``baseline``),
    else 0.
    """
    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(header(args), flush=True)
    try:
        rows = run(args, log=lambda s: print(s, file=sys.stderr, flush=True))
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return report_wrong(wrong(rows), sys.stderr, baseline) if wrong is not None else 0
