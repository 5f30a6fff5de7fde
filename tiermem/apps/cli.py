"""The ``tiermem`` command: demo, plan, bench, tune.

Every sub-command has ``--help``, prints errors as one clear line on stderr and returns an exit
code: 0 success, 1 the work failed (e.g. a plan that does not fit), 2 bad usage. The ``tiermem``
logger's records (backend choices, fallbacks, warnings) go to stderr as ``tiermem: ...`` lines.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tiermem._files import CONFIG_ERRORS
from tiermem._log import configure_cli_logging

BENCHES = {
    "transfer": "tiermem.apps.bench.transfer",
    "io": "tiermem.apps.bench.io",
    "adam": "tiermem.apps.bench.adam",
    "optim": "tiermem.apps.bench.optim",
    "activations": "tiermem.apps.bench.activations",
    "lora": "tiermem.apps.bench.lora",
    "graphs": "tiermem.apps.bench.graphs",
    "stream": "tiermem.apps.bench.stream",
}
BENCH_HELP = {
    "transfer": "TierStore H2D / D2H copies against raw pinned copy_ (needs CUDA for real "
                "numbers)",
    "io": "NVMe spill write/read against raw O_DIRECT (and kvikio when usable) in --dir",
    "adam": "the native CPU Adam kernel against torch's fused CPU AdamW",
    "optim": "training-step time and peak memory of optimizer placements (HybridAdam "
             "fractions vs GPU AdamW)",
    "activations": "training-step time and peak memory of activation offload settings",
    "lora": "LoRA fine-tune of a transformers Llama: step time and peak memory with and "
            "without offload and checkpointing, two sequence lengths (needs peft)",
    "graphs": "step time with the forward+backward in a CUDA graph, torch AdamW and "
              "HybridAdam, against eager (needs CUDA)",
    "stream": "step time of the reference GPT with every block's weights streamed against "
              "resident, torch AdamW and HybridAdam, each row with its parity (--gpu caps)",
}
COMMANDS = {
    "demo": ("tiermem.apps.demo", "train a small GPT with offloading and compare with no offload"),
    "plan": ("tiermem.apps.plan", "say what must go where (GPU / host / NVMe) and whether it fits"),
    "tune": ("tiermem.apps.tune.cli",
             "time a grid of offload settings and pick the fastest that fits"),
}


def main(argv: list[str] | None = None) -> int:
    """Run the ``tiermem`` command line; return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="tiermem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES), add_help=False)
    bench.add_argument("which", nargs="?", choices=sorted(BENCHES))
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    configure_cli_logging()
    if args.command == "bench":
        if args.which is None:
            asked = any(a in ("-h", "--help") for a in rest)
            print(bench_help(), file=sys.stdout if asked else sys.stderr)
            return 0 if asked else 2
        module_name = BENCHES[args.which]
    else:
        module_name = COMMANDS[args.command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("tiermem"):
            print(f"tiermem {args.command}: not available in this build ({exc.name})", file=sys.stderr)
            return 2
        raise
    try:
        return int(module.main(rest) or 0)
    except (ValueError, TypeError, *CONFIG_ERRORS) as exc:
        if isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError,
                                                             IsADirectoryError,
                                                             NotADirectoryError)):
            raise  # a failing disk or device is not bad usage: the traceback says where
        print(f"tiermem {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def bench_help() -> str:
    """The help of ``tiermem bench``: usage and one line per benchmark."""
    width = max(map(len, BENCHES))
    return ("usage: tiermem bench {" + ",".join(sorted(BENCHES)) + "} [options]\n\n"
            "Benchmarks (each has --help with its options and defaults):\n"
            + "\n".join(f"  {name.ljust(width)}  {BENCH_HELP[name]}" for name in BENCHES))


if __name__ == "__main__":
    sys.exit(main())
