"""The ``tiermem`` command: demo, plan, bench, tune.

Every sub-command has ``--help``, prints errors as one clear line on stderr and returns an exit
code: 0 success, 1 the work failed (e.g. a plan that does not fit), 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = {
    "transfer": "tiermem.bench.transfer",
    "io": "tiermem.bench.io",
    "adam": "tiermem.bench.adam",
    "optim": "tiermem.bench.optim",
    "activations": "tiermem.bench.activations",
}
COMMANDS = {
    "demo": ("tiermem.demo", "train a small GPT with offloading and compare with no offload"),
    "plan": ("tiermem.plan", "say what must go where (GPU / host / NVMe) and whether it fits"),
    "tune": ("tiermem.schedule.tuner", "time a grid of offload settings and pick the fastest that fits"),
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
    if args.command == "bench":
        if args.which is None:
            print("usage: tiermem bench {" + ",".join(sorted(BENCHES)) + "} [--help]",
                  file=sys.stderr)
            return 2
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
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"tiermem {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
