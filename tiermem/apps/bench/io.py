"""``tiermem bench io``: NVMe spill write/read bandwidth against raw O_DIRECT and kvikio.

All rows run in ONE process on the same directory, side by side, because the disks this runs on
are noisy (compare within a run, not across runs):

- ``raw O_DIRECT``: one plain thread doing sequential ``pwritev``/``preadv`` of large aligned
  buffers (buffered + ``fdatasync`` where the filesystem refuses O_DIRECT): the raw limit.
- ``SpillSpace posix``: :class:`~tiermem.store.nvme.SpillSpace` on the POSIX backend, for each
  thread count.
- ``kvikio CuFile`` and ``SpillSpace kvikio``: when kvikio is usable (kvikio + libcuda).
- ``SpillSpace aiofiles``: the asyncio backend.

The data moves as extents of ``--extent-bytes`` (a tensor each), all submitted at once.
Buffered writes are timed up to ``fdatasync``; the page cache is dropped
(``POSIX_FADV_DONTNEED``) between write and read (O_DIRECT bypasses it anyway). Every read is
checked against what was written, outside the timed region. GB/s are 10^9 bytes per second;
each number is the median of ``--repeat`` runs (default 3) in this one process, printed with
the spread (slowest - fastest) of those runs. A missing ``--dir`` is created (mode 0700).

Usage::

    python -m tiermem.apps.bench.io --dir /mnt/nvme --nbytes 4GiB --io-threads 1,2,4 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import wait
from dataclasses import dataclass

import torch

from tiermem import flags
from tiermem._files import make_private_dir
from tiermem.apps.bench.common import bench_main
from tiermem.config import parse_bytes
from tiermem.store.extents import round_up
from tiermem.store.io import make_backend
from tiermem.store.io.kvikio_backend import set_kvikio_threads, kvikio_usable
from tiermem.store.io.posix import host_view, open_flags, pread_all, pwrite_all
from tiermem.store.nvme import ALIGN_BYTES, SpillSpace, aligned_empty


@dataclass
class Row:
    """One line of the table: bandwidths in GB/s (10^9 B/s), ``None`` when not measured."""

    what: str
    threads: int | str
    write_gbps: float | None = None
    read_gbps: float | None = None
    note: str = ""
    write_spread: tuple[float, float] | None = None
    """(slowest, fastest) write GB/s of the repeated runs (None: one run or none)."""
    read_spread: tuple[float, float] | None = None
    """(slowest, fastest) read GB/s of the repeated runs."""


def _drop_cache(path: str) -> None:
    """Write back and drop the page cache of ``path`` (best effort; no-op on tmpfs)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)  # dirty pages cannot be dropped: write them back first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fdatasync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _median_spread(values: list[float | None]
                   ) -> tuple[float | None, tuple[float, float] | None]:
    """Median and (min, max) of the measured values (None entries are not measured)."""
    got = [v for v in values if v is not None]
    if not got:
        return None, None
    return statistics.median(got), ((min(got), max(got)) if len(got) > 1 else None)


def bench_raw(workdir: str, src: torch.Tensor, dst: torch.Tensor, block_bytes: int) -> Row:
    """Sequential write then read of ``src`` from one thread, O_DIRECT when the fs allows.

    Raises:
        OSError: the file cannot be written or read.
    """
    path = os.path.join(workdir, "raw.bin")
    nbytes = src.numel()
    try:
        fd = os.open(path, open_flags(create=True, o_direct=True), 0o600)
        direct = True
    except OSError:
        fd = os.open(path, open_flags(create=True, o_direct=False), 0o600)
        direct = False
    try:
        sview, dview = host_view(src), host_view(dst)
        t0 = time.perf_counter()
        for off in range(0, nbytes, block_bytes):
            pwrite_all(fd, sview[off:off + block_bytes], off, path)
        if not direct:
            os.fdatasync(fd)
        t_write = time.perf_counter() - t0
        _drop_cache(path)
        t0 = time.perf_counter()
        for off in range(0, nbytes, block_bytes):
            pread_all(fd, dview[off:off + block_bytes], off, path)
        t_read = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    if not torch.equal(src, dst):
        raise RuntimeError("raw read returned different bytes than were written")
    return Row("raw O_DIRECT" if direct else "raw buffered+fdatasync", 1,
               _gbps(nbytes, t_write), _gbps(nbytes, t_read))


def bench_kvikio_direct(workdir: str, src: torch.Tensor, dst: torch.Tensor, threads: int) -> Row:
    """One ``CuFile.pwrite``/``pread`` of the whole buffer on kvikio's pool of ``threads``.

    Raises:
        Exception: whatever kvikio raises.
    """
    import kvikio  # noqa: PLC0415  (optional dependency)

    set_kvikio_threads(kvikio, threads)
    path = os.path.join(workdir, f"kvikio-{threads}.bin")
    os.close(os.open(path, open_flags(create=True, o_direct=False), 0o600))
    nbytes = src.numel()
    f = kvikio.CuFile(path, "r+")
    try:
        t0 = time.perf_counter()
        moved = f.pwrite(src.numpy(), nbytes, 0).get()
        _fdatasync(path)
        t_write = time.perf_counter() - t0
        _drop_cache(path)
        t0 = time.perf_counter()
        got = f.pread(dst.numpy(), nbytes, 0).get()
        t_read = time.perf_counter() - t0
    finally:
        f.close()
        os.unlink(path)
    if moved != nbytes or got != nbytes or not torch.equal(src, dst):
        raise RuntimeError(f"kvikio moved {moved}/{got} of {nbytes} bytes or returned other bytes")
    return Row("kvikio CuFile", threads, _gbps(nbytes, t_write), _gbps(nbytes, t_read))


def bench_spill(workdir: str, src: torch.Tensor, dst: torch.Tensor, backend_name: str,
                threads: int, extent_bytes: int, chunk_bytes: int) -> Row:
    """Spill ``src`` as extents of ``extent_bytes`` through a SpillSpace, then read them back.

    Raises:
        SpillError: an extent write or read failed.
    """
    nbytes = src.numel()
    backend = make_backend(backend_name, threads)
    space = SpillSpace(workdir, round_up(nbytes, ALIGN_BYTES) + extent_bytes, backend=backend,
                       o_direct="auto", checksum=True, chunk_bytes=chunk_bytes,
                       owns_backend=True)
    try:
        pieces = [(off, min(extent_bytes, nbytes - off)) for off in range(0, nbytes, extent_bytes)]
        t0 = time.perf_counter()
        futs = [space.write(i, src[off:off + n], n) for i, (off, n) in enumerate(pieces)]
        extents = [f.result() for f in futs]
        if not space.o_direct:
            _fdatasync(space.path)
        t_write = time.perf_counter() - t0
        _drop_cache(space.path)
        t0 = time.perf_counter()
        futs = [space.read(i, ext, dst[off:off + n])
                for i, ((off, n), ext) in enumerate(zip(pieces, extents))]
        wait(futs)
        for f in futs:
            f.result()
        t_read = time.perf_counter() - t0
        note = f"{'O_DIRECT' if space.o_direct else 'buffered'}, {space.checksum_name}"
    finally:
        space.close()
    if not torch.equal(src, dst):
        raise RuntimeError(f"SpillSpace/{backend_name} returned different bytes than were written")
    return Row(f"SpillSpace {backend_name}", threads, _gbps(nbytes, t_write),
               _gbps(nbytes, t_read), note)


def format_table(rows: list[Row]) -> str:
    """Return the rows as an aligned text table: median GB/s with the spread of the repeated
    runs in brackets, and "% of raw" (write/read, medians) per row."""
    raw = rows[0] if rows and rows[0].what.startswith("raw") else None

    def num(v, spread=None):
        if v is None:
            return "-"
        return f"{v:.2f}" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")

    def pct(v, ref):
        return "-" if v is None or not ref else f"{100 * v / ref:.0f}"

    header = ("what", "threads", "write GB/s (spread)", "read GB/s (spread)", "% of raw (w/r)",
              "note")
    lines = [header]
    for r in rows:
        rel = (f"{pct(r.write_gbps, raw and raw.write_gbps)}/"
               f"{pct(r.read_gbps, raw and raw.read_gbps)}")
        lines.append((r.what, str(r.threads), num(r.write_gbps, r.write_spread),
                      num(r.read_gbps, r.read_spread), rel, r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for j, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tiermem bench io", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True,
                   help="directory on the disk to measure (created, mode 0700, if missing)")
    p.add_argument("--nbytes", default="256MiB", help="bytes moved per row (default 256MiB)")
    p.add_argument("--extent-bytes", default="64MiB", help="bytes per spilled extent (64MiB)")
    flags.add(p, "bench io", "--io-chunk-bytes", dest="chunk_bytes", default="8MiB",
              help="SpillSpace I/O chunk size (8MiB)")
    p.add_argument("--block-bytes", default="64MiB", help="raw row's bytes per syscall (64MiB)")
    flags.add(p, "bench io", "--io-threads", dest="threads", default="1,2,4",
              help="thread counts of the posix/kvikio rows")
    p.add_argument("--aiofiles-threads", default="2", help="thread counts of the aiofiles rows")
    p.add_argument("--repeat", type=int, default=3,
                   help="runs per row; the median and the spread are shown (default 3)")
    return p.parse_args(argv)


def run(args: argparse.Namespace, log=print) -> list[Row]:
    """Measure every row and return them (raw first).

    Raises:
        ValueError: bad sizes or thread lists, or ``--dir`` is not a writable directory.
    """
    nbytes = parse_bytes(args.nbytes, "--nbytes")
    extent_bytes = parse_bytes(args.extent_bytes, "--extent-bytes")
    chunk_bytes = parse_bytes(args.chunk_bytes, "--io-chunk-bytes")
    block_bytes = parse_bytes(args.block_bytes, "--block-bytes")
    for name, v in (("--nbytes", nbytes), ("--extent-bytes", extent_bytes),
                    ("--io-chunk-bytes", chunk_bytes), ("--block-bytes", block_bytes)):
        if v < ALIGN_BYTES or v % ALIGN_BYTES:
            raise ValueError(f"{name}={v} must be a positive multiple of {ALIGN_BYTES} "
                             f"(O_DIRECT alignment)")
    threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    aio_threads = [int(t) for t in str(args.aiofiles_threads).split(",") if t.strip()]
    if not threads or min(threads + aio_threads) < 1:
        raise ValueError(f"--io-threads={args.threads!r} must list ints >= 1, e.g. 1,2,4")
    if args.repeat < 1:
        raise ValueError(f"--repeat={args.repeat} must be >= 1 (3 or more for a median and a "
                         f"spread)")
    make_private_dir(args.dir, "--dir", log)
    if not os.access(args.dir, os.W_OK):
        raise ValueError(f"--dir={args.dir!r} is not writable; fix: pick a directory you can "
                         f"write on the disk to measure")
    repeat = args.repeat

    # Pattern data (1 MiB random, tiled): incompressible enough, cheap to make.
    src = aligned_empty(nbytes)
    seed = torch.randint(0, 256, (min(nbytes, 1 << 20),), dtype=torch.uint8)
    for off in range(0, nbytes, seed.numel()):
        n = min(seed.numel(), nbytes - off)
        src[off:off + n].copy_(seed[:n])
    dst = aligned_empty(nbytes)

    kv_ok, kv_why = kvikio_usable()
    workdir = tempfile.mkdtemp(prefix="tiermem-bench-", dir=args.dir)  # private: mode 0700
    cases: list[tuple[str, int | str, object]] = [("raw", 1, lambda: bench_raw(
        workdir, src, dst, block_bytes))]
    for t in threads:
        cases.append(("SpillSpace posix", t, lambda t=t: bench_spill(
            workdir, src, dst, "posix", t, extent_bytes, chunk_bytes)))
    for t in threads:
        cases.append(("kvikio CuFile", t, (lambda t=t: bench_kvikio_direct(workdir, src, dst, t))
                      if kv_ok else None))
    for t in threads:
        cases.append(("SpillSpace kvikio", t, (lambda t=t: bench_spill(
            workdir, src, dst, "kvikio", t, extent_bytes, chunk_bytes)) if kv_ok else None))
    for t in aio_threads:
        cases.append(("SpillSpace aiofiles", t, lambda t=t: bench_spill(
            workdir, src, dst, "aiofiles", t, extent_bytes, chunk_bytes)))

    rows: list[Row] = []
    try:
        for what, t, fn in cases:
            if fn is None:
                if not any(r.what == what for r in rows):
                    rows.append(Row(what, "-", note=f"skipped: {kv_why}"))
                continue
            results, note = [], ""
            for _ in range(repeat):
                try:
                    results.append(fn())
                except Exception as exc:  # noqa: BLE001  (one failing row must not end the run)
                    note = f"failed: {type(exc).__name__}: {exc}"
                    break
            if results:
                row = results[0]
                row.write_gbps, row.write_spread = _median_spread([r.write_gbps for r in results])
                row.read_gbps, row.read_spread = _median_spread([r.read_gbps for r in results])
                row.note = "; ".join(x for x in (row.note, note) if x)
            else:
                row = Row(what, t, note=note)
            rows.append(row)
            log(f"  {row.what} threads={row.threads}: write {row.write_gbps or 0:.2f} GB/s, "
                f"read {row.read_gbps or 0:.2f} GB/s {row.note}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; returns the process exit code (0 ok, 2 bad input)."""
    return bench_main(
        argv, _parse_args,
        lambda a: (f"tiermem bench io: dir={a.dir} nbytes={a.nbytes} extent={a.extent_bytes} "
                   f"chunk={a.chunk_bytes} repeat={a.repeat} (GB/s = 1e9 B/s, median of the "
                   f"repeats, spread in brackets)"),
        run, format_table)


if __name__ == "__main__":
    sys.exit(main())
