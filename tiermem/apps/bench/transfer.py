"""``tiermem bench transfer``: TierStore H2D/D2H against a raw pinned ``copy_``, side by side.

Rows, in one run on the same buffers' sizes:
- raw pinned copy: ``dev.copy_(pinned, non_blocking=True)`` on a side stream (the limit);
- TierStore: ``prefetch(key, "gpu").wait()`` (cpu -> gpu) and ``evict(key, "cpu").wait()``
  (gpu -> cpu) of keys held in the pinned pool;
- both directions at once: raw (two streams) and TierStore (one key up while another goes down).
On a machine without CUDA the "device" is the CPU and the rows measure host copies.
Each rate is the median of ``--repeats`` timed copies (after a warm-up) in this one process,
printed with the spread (slowest - fastest) of those copies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiermem import StoreConfig, TierStore
from tiermem.apps.bench.common import time_s
from tiermem.config import parse_bytes


def _rates(nbytes: int, times: list[float]) -> tuple[float, float, float]:
    """``(median, slowest, fastest)`` bytes/s of the timed runs."""
    return nbytes / statistics.median(times), nbytes / max(times), nbytes / min(times)


def run(nbytes: int, repeats: int = 10) -> list[dict]:
    """Measure and return the rows: ``what``, ``raw GB/s`` and ``TierStore GB/s`` (medians),
    ``raw spread`` and ``TierStore spread`` (slowest, fastest GB/s), ``% of raw`` (medians).

    Raises:
        ValueError: ``nbytes`` < 4096 or ``repeats`` < 1.
    """
    if nbytes < 4096 or repeats < 1:
        raise ValueError(f"bench transfer: nbytes={nbytes} must be >= 4096 and repeats={repeats} >= 1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).random_() for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device=device).random_() for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)] if cuda else [None, None]

    def raw(direction: str, which: int = 0):
        ctx = torch.cuda.stream(streams[which]) if cuda else _nullcontext()
        with ctx:
            if direction == "h2d":
                dev[which].copy_(host[which], non_blocking=True)
            else:
                host[which].copy_(dev[which], non_blocking=True)

    def raw_both():
        raw("h2d", 0)
        raw("d2h", 1)

    rows = []
    raw_h2d = _rates(nbytes, time_s(lambda: raw("h2d"), repeats, device))
    raw_d2h = _rates(nbytes, time_s(lambda: raw("d2h"), repeats, device))
    raw_bi = _rates(2 * nbytes, time_s(raw_both, repeats, device))
    del dev

    store = TierStore(StoreConfig(gpu_bytes=4 * nbytes, cpu_bytes=4 * nbytes,
                                  pool_slab_bytes=nbytes))
    try:
        store.put("a", host[0], tier="cpu")
        store.put("b", host[1], tier="cpu")

        def store_h2d():
            store.prefetch("a", "gpu").wait()
            store.evict("a", "cpu").wait()

        def store_d2h():
            store.evict("b", "cpu").wait()
            store.prefetch("b", "gpu").wait()

        store.prefetch("b", "gpu").wait()
        # one direction alone: time both halves of a round trip separately
        h2d_s, d2h_s = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            store.prefetch("a", "gpu").wait()
            t1 = time.perf_counter()
            store.evict("a", "cpu").wait()
            t2 = time.perf_counter()
            h2d_s.append(t1 - t0)
            d2h_s.append(t2 - t1)
        st_h2d = _rates(nbytes, h2d_s[1:])
        st_d2h = _rates(nbytes, d2h_s[1:])

        def store_both():  # "a" goes up while "b" goes down, then swap roles
            up, down = ("a", "b") if store.tier_of("a") == "cpu" else ("b", "a")
            f1 = store.prefetch(up, "gpu")
            f2 = store.evict(down, "cpu")
            f1.wait()
            f2.wait()

        st_bi = _rates(2 * nbytes, time_s(store_both, repeats, device))
    finally:
        store.close()
    for what, raw_bps, st_bps in (("H2D (host -> device)", raw_h2d, st_h2d),
                                  ("D2H (device -> host)", raw_d2h, st_d2h),
                                  ("both directions at once", raw_bi, st_bi)):
        rows.append({"what": what, "raw GB/s": raw_bps[0] / 1e9,
                     "TierStore GB/s": st_bps[0] / 1e9,
                     "raw spread": (raw_bps[1] / 1e9, raw_bps[2] / 1e9),
                     "TierStore spread": (st_bps[1] / 1e9, st_bps[2] / 1e9),
                     "% of raw": 100 * st_bps[0] / raw_bps[0]})
    return rows


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def format_table(rows: list[dict], header: str) -> str:
    """Render rows as a fixed-width table: medians, the spread (slowest-fastest) in brackets."""
    def cell(r: dict, name: str) -> str:
        lo, hi = r[f"{name} spread"]
        return f"{r[f'{name} GB/s']:.2f} ({lo:.2f}-{hi:.2f})"

    lines = [header, f"{'what':<26}{'raw GB/s (spread)':>24}{'TierStore GB/s (spread)':>26}"
                     f"{'% of raw':>10}"]
    for r in rows:
        lines.append(f"{r['what']:<26}{cell(r, 'raw'):>24}{cell(r, 'TierStore'):>26}"
                     f"{r['% of raw']:>9.0f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``tiermem bench transfer [--nbytes 1GiB] [--repeats 10]``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="tiermem bench transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--nbytes", default="1GiB" if torch.cuda.is_available() else "64MiB",
                        help="bytes per copy (default 1GiB on CUDA, 64MiB on CPU)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed copies per row; median and spread are printed (default 10, "
                             "at least 3)")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats} must be >= 3 (a median and a spread need three "
                     f"timings)")
    nbytes = parse_bytes(args.nbytes, "--nbytes")
    rows = run(nbytes, args.repeats)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA)"
    print(format_table(rows, f"bench transfer: {nbytes / 2**20:.0f} MiB per copy on {device}; "
                             f"median of {args.repeats} timed copies, spread in brackets"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
