"""``tiermem bench adam``: the native CPU Adam kernel against torch's fused CPU AdamW.

Prints, from one run on one machine, params updated per second for:

* ``native fp32``: fp32 grads, fp32 master params and moments (:func:`adam_step_`);
* ``native mixed``: bf16 grads in, fp32 master params and moments, bf16 params out, one pass;
* ``native mixed, bf16 moments``: as above with the moments stored in bf16;
* ``torch fused fp32``: ``torch._fused_adamw_`` (what ``torch.optim.AdamW(fused=True)`` runs);
* ``torch cast+fused+cast``: bf16 grads copied to fp32, the fused step, params copied to bf16
  (torch's way to do what ``native mixed`` does), into preallocated buffers;
* ``torch cast+fused+cast, allocating``: the same with ``grad.float()`` / ``param.to(bf16)``
  allocating new tensors each step, as straightforward code does (page faults included).

Each row is timed ``--repeats`` times (after one warm-up step) in the same process; the table
gives the median rate and the spread (slowest - fastest) of those timed steps, the logical
traffic per param (bytes read + written, write-allocate not counted) and the resulting logical
GB/s. For reference the header gives the host bandwidth of a ``Tensor.copy_`` and an in-place
``Tensor.add_`` on 1 GiB buffers measured in the same run. They are *not* a bound on the
kernels, which can reach more logical traffic than either probe (on the H200 machine torch's
fused fp32 step ran at 4.38 G params/s x 28 B = 123 GB/s against 111 GB/s for ``add_``,
docs/benchmarks_archive.md); an earlier version of this table called the larger probe a bound
and printed "% of bound" above 100%.

Usage: ``tiermem bench adam --numel 200000000`` or ``python -m tiermem.apps.bench.adam --numel
2000000``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence

import torch

from tiermem import _native
from tiermem._log import logger, progress
from tiermem.apps.bench.common import time_s
from tiermem.optim.cpu_adam import adam_step_, native_available

__all__ = ["run", "main", "copy_bandwidth_bytes_per_s", "inplace_bandwidth_bytes_per_s",
           "format_table"]

_HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

# Logical bytes per param (read + write) of each row.
_BYTES = {
    # read p, g, m, v (4 x 4) + write p, m, v (3 x 4)
    "native fp32": 28,
    # read g bf16 (2) + p, m, v (12); write p, m, v (12) + param_out bf16 (2)
    "native mixed": 28,
    # read g bf16 (2) + p (4) + m, v bf16 (4); write p (4) + m, v bf16 (4) + param_out (2)
    "native mixed, bf16 moments": 20,
    "torch fused fp32": 28,
    # cast g: read 2 + write 4; fused step: 28; cast p: read 4 + write 2
    "torch cast+fused+cast": 40,
    "torch cast+fused+cast, allocating": 40,
}


def copy_bandwidth_bytes_per_s(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Host memory copy bandwidth with ``dst.copy_(src)`` on torch's threads.

    Args:
        nbytes: size of the copied buffer in bytes (use far more than the last-level cache).
        repeats: timed copies; the median is used.

    Returns:
        Bytes moved per second, counting each copied byte twice (one read, one write; the
        write-allocate read of ``dst`` that regular stores cause is not counted).

    Raises:
        ValueError: if ``nbytes`` < 4096 or ``repeats`` < 1.
    """
    src, dst = _bandwidth_buffers(nbytes, repeats)
    return 2 * src.numel() * 4 / statistics.median(time_s(lambda: dst.copy_(src), repeats))


def inplace_bandwidth_bytes_per_s(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Host memory bandwidth of an in-place update ``a.add_(b)`` on torch's threads.

    Adam's traffic is of this kind (it reads each line of params and moments, then writes it
    back), with no write-allocate reads, unlike a copy into a destination it never read.

    Args:
        nbytes: size of each of the two buffers in bytes.
        repeats: timed updates; the median is used.

    Returns:
        Bytes moved per second, counting 3 bytes per byte of ``a`` (read a, read b, write a).

    Raises:
        ValueError: if ``nbytes`` < 4096 or ``repeats`` < 1.
    """
    a, b = _bandwidth_buffers(nbytes, repeats)
    return 3 * a.numel() * 4 / statistics.median(time_s(lambda: a.add_(b), repeats))


def _bandwidth_buffers(nbytes: int, repeats: int) -> tuple[torch.Tensor, torch.Tensor]:
    if nbytes < 4096:
        raise ValueError(f"nbytes={nbytes} is too small to measure bandwidth (use >= 4096)")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    return torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)


def run(numel: int = 200_000_000, repeats: int = 5, threads: int | None = None) -> list[dict]:
    """Time every row ``repeats`` times on ``numel`` params; see the module docstring.

    Args:
        numel: params per step (elements). 200M is the reference size; use 2M+ for a quick run.
        repeats: timed steps per row (after one warm-up step); the median and the spread are
            reported.
        threads: torch (and native) threads for the run; ``None`` keeps
            ``torch.get_num_threads()``.

    Returns:
        One dict per row with keys ``name``, ``numel``, ``threads``, ``repeats``,
        ``gparams_per_s`` (median of the timed steps, 1e9 params/s), ``gparams_min`` and
        ``gparams_max`` (slowest and fastest step), ``ms_per_step`` (median),
        ``bytes_per_param`` (logical bytes read + written), ``logical_gb_per_s`` (median rate
        times bytes per param, 1e9 bytes/s), ``copy_gb_per_s`` and ``inplace_gb_per_s`` (host
        bandwidth probes for reference, 1e9 bytes/s, see :func:`copy_bandwidth_bytes_per_s`,
        :func:`inplace_bandwidth_bytes_per_s`; not a bound), ``isa`` (native kernel ISA or
        ``"-"``), ``speedup_vs_torch`` (median against median of the matching torch row: fp32
        rows vs torch fused fp32, mixed rows vs the preallocated torch cast+fused+cast).

    Raises:
        ValueError: if ``numel`` < 1, ``repeats`` < 1 or ``threads`` < 1.
    """
    if numel < 1:
        raise ValueError(f"numel={numel} must be >= 1")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads} must be >= 1 (or None for torch's setting)")
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(numel, repeats)
    finally:
        torch.set_num_threads(old_threads)


@torch.no_grad()
def _run(numel: int, repeats: int) -> list[dict]:
    nthreads = torch.get_num_threads()
    bw_bytes = max(numel * 4, 1 << 30)
    copy_bw = copy_bandwidth_bytes_per_s(bw_bytes, repeats)
    inplace_bw = inplace_bandwidth_bytes_per_s(bw_bytes, repeats)

    gen = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=gen)
    g32 = torch.randn(numel, generator=gen) * 1e-3
    g16 = g32.to(torch.bfloat16)
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    out16 = torch.empty(numel, dtype=torch.bfloat16)
    g_cast = torch.empty(numel)
    m16 = torch.zeros(numel, dtype=torch.bfloat16)
    v16 = torch.zeros(numel, dtype=torch.bfloat16)
    step = [0]

    def next_step() -> int:
        step[0] += 1
        return step[0]

    fused = getattr(torch, "_fused_adamw_", None)

    def torch_fused(grad: torch.Tensor) -> None:
        s = torch.tensor(float(next_step()))
        if fused is not None:
            fused([p], [grad], [m], [v], [], [s], amsgrad=False, maximize=False, **_HYPER)
        else:  # pragma: no cover - torch < 2.4 has no CPU fused AdamW
            raise RuntimeError("this torch has no torch._fused_adamw_ (needs torch >= 2.4)")

    def torch_cast_fused_cast() -> None:
        g_cast.copy_(g16)
        torch_fused(g_cast)
        out16.copy_(p)

    def torch_cast_fused_cast_alloc() -> None:
        torch_fused(g16.float())
        p.to(torch.bfloat16)  # the straightforward way: new tensors each step

    rows: list[tuple[str, Callable[[], None]]] = []
    if native_available():
        rows += [
            ("native fp32", lambda: adam_step_(p, g32, m, v, step=next_step(), **_HYPER)),
            ("native mixed", lambda: adam_step_(p, g16, m, v, step=next_step(),
                                                param_out=out16, **_HYPER)),
            ("native mixed, bf16 moments", lambda: adam_step_(p, g16, m16, v16,
                                                              step=next_step(),
                                                              param_out=out16, **_HYPER)),
        ]
    rows += [("torch fused fp32", lambda: torch_fused(g32)),
             ("torch cast+fused+cast", torch_cast_fused_cast),
             ("torch cast+fused+cast, allocating", torch_cast_fused_cast_alloc)]

    isa = _native.adam_isa() if native_available() else "-"
    results = []
    bar = progress(total=len(rows), desc="bench adam", unit="row")
    for name, fn in rows:
        times = time_s(fn, repeats)
        t = statistics.median(times)
        rate = numel / t / 1e9
        results.append(dict(name=name, numel=numel, threads=nthreads, repeats=repeats,
                            gparams_per_s=rate, gparams_min=numel / max(times) / 1e9,
                            gparams_max=numel / min(times) / 1e9,
                            ms_per_step=t * 1e3, bytes_per_param=_BYTES[name],
                            logical_gb_per_s=rate * _BYTES[name],
                            copy_gb_per_s=copy_bw / 1e9,
                            inplace_gb_per_s=inplace_bw / 1e9,
                            isa=isa if name.startswith("native") else "-"))
        bar.update(1)
    bar.close()
    by_name = {r["name"]: r for r in results}
    for r in results:
        # mixed rows compare with the preallocated (faster) torch variant
        ref = "torch fused fp32" if r["name"].endswith("fp32") else "torch cast+fused+cast"
        r["speedup_vs_torch"] = r["gparams_per_s"] / by_name[ref]["gparams_per_s"]
    return results


def format_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`run` as a Markdown table, with the run's conditions above it."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    head = (f"numel {r0['numel']:,}, {r0['threads']} threads, torch {torch.__version__}, "
            f"native ISA {next((r['isa'] for r in rows if r['isa'] != '-'), '-')}; median and "
            f"spread (slowest - fastest) of {r0['repeats']} timed steps per row; logical GB/s = "
            f"G params/s x bytes read + written per param. Host bandwidth for reference (not a "
            f"bound): copy_ {r0['copy_gb_per_s']:.1f} GB/s (read + write), in-place add_ "
            f"{r0['inplace_gb_per_s']:.1f} GB/s\n\n")
    lines = ["| kernel | G params/s (median) | spread | ms/step | B/param | logical GB/s "
             "| vs torch |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['gparams_per_s']:.3f} | {r['gparams_min']:.3f} - "
                     f"{r['gparams_max']:.3f} | {r['ms_per_step']:.2f} | "
                     f"{r['bytes_per_param']} | {r['logical_gb_per_s']:.1f} | "
                     f"{r['speedup_vs_torch']:.2f}x |")
    return head + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tiermem bench adam``; prints the table (or JSON with ``--json``).

    Args:
        argv: command-line arguments after ``bench adam`` (``None``: ``sys.argv[1:]``).

    Returns:
        Process exit status (0).

    Raises:
        SystemExit: on bad command-line arguments (argparse).
    """
    parser = argparse.ArgumentParser(prog="tiermem bench adam", description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=20_000_000,
                        help="params per step (default 20M; the reference run uses 200000000)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed steps per row; the median and spread are printed "
                             "(default 5, at least 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch/native threads (default: torch.get_num_threads())")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if args.numel < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--numel and --threads must be >= 1")
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats} must be >= 3 (a median and a spread need "
                     f"three timings)")
    if not native_available():
        logger.warning("bench adam: native library unavailable (%s); torch rows only",
                       _native.load_error())
    rows = run(args.numel, args.repeats, args.threads)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
